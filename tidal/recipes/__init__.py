"""Applications of the library: the recipes that build tidal's embedded models.

Each recipe trains a model with tidal's own parts (the envs, the rollout, the torch engine, the
reward pool) and writes it as a Hugging Face directory: `tidal build-default-model` (tiny.py),
`build-tool-model` (tool_model.py), `build-browser-model` (browser_model.py),
`build-default-vlm` (vlm_build.py, over the architecture of tiny_vlm.py) and `tidal train-rm`
(train_rm.py). They sit at the top of the package order, beside the CLI, because they use every
layer below; the library never imports them. The shipped directories stay under
tidal/models/assets, named by tidal/models (`DEFAULT_MODEL_DIR`, `TOOL_MODEL_DIR`, ...).
"""
