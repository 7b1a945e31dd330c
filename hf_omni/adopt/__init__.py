"""Released composite models adopted as they are (`OmniModel.from_model`)."""
