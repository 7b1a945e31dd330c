"""What a run measures per module: the seconds of forward + backward at logging steps (`profile`, timed by
`timing_marks`) and the bytes each module holds on this rank (`module_bytes`)."""
