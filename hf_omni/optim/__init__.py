"""What happens between backward and the next step, per module: one optimizer and one scheduler per trainable
module behind composites Trainer's loop drives (`optimizers`), the gradients' norms, clipping and fp16's found-inf
(`gradients`), and the EMA stepped after each optimizer step (`ema`)."""
