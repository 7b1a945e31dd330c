"""The Hub: pushing a saved model (`push`), downloading a composition (`download`), deciding when a frozen module
is linked (`link`), model cards (`cards`)."""
