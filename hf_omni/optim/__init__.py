"""What happens between backward and the next step, per module: one optimizer and one scheduler per trainable
module behind composites Trainer's loop drives (`optimizers`), and the gradients' norms, clipping and fp16's
found-inf (`gradients`)."""
