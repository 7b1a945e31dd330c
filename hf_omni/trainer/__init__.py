"""OmniTrainer: the Trainer subclass (`trainer`), the Trainer methods it relies on (`hooks`), its Hub half (`hub`),
label smoothing inside the modules (`label_smoothing`)."""
