"""Names of the files and folders of a run's checkpoints (the layout is described in ds_checkpoint.py).

Its own module so that both the writer (ds_checkpoint) and the universal converter read the same
names without importing each other.
"""

COMPLETE = "COMPLETE"
MANIFEST = "MANIFEST.json"  # every file of a tag, its size and crc32 (dsclip.checkpoint.manifest), written last
LATEST = "latest"
STATE_FILE = "dsclip_state.json"
MODEL_CONFIG_FILE = "model_config.json"  # {"model_cfg": <resolved model config>}, as dsclip.model.save_model writes
TOKENIZER_FILE = "tokenizer.model"  # the run's SentencePiece model, copied into the run folder
TOKENIZER_SPEC_FILE = "tokenizer.json"  # {"tokenizer": "open_clip:NAME"} for non-file tokenizers
RUN_CONFIG_FILE = "run_config.yaml"  # RUN/run_config.yaml, written by dsclip.train.build (read by convert)
PARTIAL_PREFIX = ".partial."
TRASH_PREFIX = ".trash."
DIVERGED = "DIVERGED"  # {"first_bad_step": N, ...}: a later run diverged from this tag's weights (never resumed)
