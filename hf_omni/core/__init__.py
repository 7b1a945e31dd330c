"""The lowest layer, importing nothing of hf_omni but `compat`: the package's errors (`errors`), dtypes named once
(`dtypes`), declaring a settings key once (`keys`), the process group (`dist`), progress bars (`progress`), the
root config of a composed model (`config`), the one registry every extension point uses (`registry`) and the
refusals each feature registers (`refusals`)."""
