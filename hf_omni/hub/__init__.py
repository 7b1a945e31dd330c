"""The Hub: pushing a saved model (`push`: a composition's modules and root config; `checkpoint_push`: a checkpoint
as a folder of the repo; `commit`: one commit), downloading a composition (`download`), deciding when a frozen
module is linked (`link`), model cards (`cards`) and repo names (`ids`). An adopted model's and a pipeline's one
repo are their own (`adopt/hub_push.py`, `diffusion/hub_push.py`)."""
