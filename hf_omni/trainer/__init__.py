"""OmniTrainer: the Trainer subclass (`trainer`), the Trainer methods it relies on (`hooks`), its Hub half (`hub`),
label smoothing inside the modules (`label_smoothing`), evaluation and prediction (`evaluation`), its data
(`data`), the steps its profile times (`profile_steps`), its accumulation window's exchange (`step_window`) and the
losses it logs per module (`loss_parts`)."""
