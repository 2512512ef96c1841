"""Data settings (OpenCLIP flag names). The run config embeds this as its data section."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dsclip.config_base import ConfigError
from dsclip.data.preprocess import INTERPOLATIONS, RESIZE_MODES, check_mean_std, parse_aug_cfg
from dsclip.data.sample_keys import DEFAULT_IMAGE_KEY, DEFAULT_TEXT_KEY, SampleKeys
from dsclip.data.shards import ImageLimits

DATASET_TYPES = ("auto", "demo", "webdataset", "csv", "synthetic")


@dataclass
class DataConfig:
    train_data: str | None = field(
        default=None,
        metadata={
            "help": "Training data: webdataset shards with brace expansion (data/{00000..00099}.tar), "
            "several sources joined by '::'; or a CSV/TSV file. Unused for dataset_type=demo."
        },
    )
    train_num_samples: int | None = field(
        default=None,
        metadata={
            "help": "Samples per epoch (global). Required for webdataset (sets steps per epoch = "
            "train_num_samples // (batch_size * world_size)); for demo it overrides demo_num_samples."
        },
    )
    dataset_type: str = field(
        default="auto",
        metadata={
            "help": "auto|demo|webdataset|csv|synthetic. auto: .csv/.tsv -> csv, otherwise webdataset, none -> demo. "
            "synthetic (OpenCLIP's, for throughput tests): one black image of the model's size and one caption, "
            "--train-num-samples of them per epoch.",
            "choices": DATASET_TYPES,
        },
    )
    dataset_resampled: bool = field(
        default=False, metadata={"help": "Sample shards with replacement (infinite stream), as OpenCLIP."}
    )
    train_data_upsampling_factors: str | None = field(
        default=None,
        metadata={
            "help": "'::'-separated relative sampling weights, one per train_data source (needs "
            "dataset_resampled). Default: proportional to each source's shard count."
        },
    )
    data_decode: str = field(
        default="auto",
        metadata={
            "help": "Where training images are decoded and augmented: cpu = workers decode (JPEG at a reduced "
            "DCT scale, crop before resize) and ship uint8, normalised on the device; pil = the float PIL "
            "path of OpenCLIP; gpu = workers ship the encoded JPEG and its crop box, the batch is decoded (nvJPEG), "
            "cropped and normalised on the device (needs CUDA; PNG/WebP/CMYK are decoded by the workers and counted); "
            "auto = gpu where CUDA is present, else cpu. Webdataset input (CSV and demo keep their own).",
            "choices": ("auto", "cpu", "gpu", "pil"),
        },
    )
    workers: int = field(default=1, metadata={"help": "DataLoader worker processes per rank (0 = main process)."})
    shuffle_buffer: int = field(
        default=5000, metadata={"help": "Webdataset sample shuffle buffer per worker (0 disables)."}
    )
    min_image_size: int = field(
        default=16,
        metadata={
            "help": "Skip (and count as small_image) training images whose shorter side is below this many pixels: "
            "1x1 tracking pixels and placeholders upscaled to the model's size teach nothing (0: off)."
        },
    )
    max_image_size: int = field(
        default=4096,
        metadata={
            "help": "Skip (and count as large_image) training images whose longer side is above this many pixels: "
            "web sets are resized at download, and an 8000x8000 image costs a worker seconds and 192 MB (0: off)."
        },
    )
    image_key: str = field(
        default=DEFAULT_IMAGE_KEY,
        metadata={
            "help": "Webdataset member suffix holding the image, ';'-separated alternatives in priority order "
            "(OpenCLIP main's flag and default), e.g. 'jpg;png;jpeg;webp' or 'tif'."
        },
    )
    text_key: str = field(
        default=DEFAULT_TEXT_KEY,
        metadata={
            "help": "Webdataset member suffix holding the caption text, ';'-separated alternatives (OpenCLIP main's "
            "flag and default), e.g. 'txt;cls'; a member with several lines is several captions. Ignored when "
            "--json-text-key is set."
        },
    )
    json_text_key: str | None = field(
        default=None,
        metadata={
            "help": "Read the caption from this field of each sample's .json member instead of a text member; "
            "';'-separated fields in priority order, the first non-empty string wins (OpenCLIP main's flag). "
            "Takes precedence over --text-key."
        },
    )
    csv_img_key: str = field(default="filepath", metadata={"help": "CSV column holding image paths."})
    csv_caption_key: str = field(default="title", metadata={"help": "CSV column holding captions."})
    csv_separator: str = field(default="\t", metadata={"help": "CSV field separator ('\\t' for TSV)."})
    val_data: str | None = field(
        default=None,
        metadata={"help": "Retrieval validation set: webdataset shards or CSV (same formats as train_data)."},
    )
    val_num_samples: int | None = field(default=None, metadata={"help": "Cap on validation samples."})
    zeroshot_data: str | None = field(
        default=None,
        metadata={"help": "Zero-shot class-folder dataset (DIR/<class>/*.jpg), or 'demo' for the demo's held-out set."},
    )
    imagenet_val: str | None = field(
        default=None,
        metadata={
            "help": "ImageNet validation folder (DIR/<wnid>/*.JPEG) for zero-shot: built-in ImageNet-1k class "
            "names and OpenCLIP's prompts (OpenCLIP's flag; the same as --zeroshot-data DIR)."
        },
    )
    imagenet_v2: str | None = field(
        default=None,
        metadata={
            "help": "ImageNet-V2 folder for zero-shot (OpenCLIP's flag; not downloaded): OpenCLIP's location "
            "holding ImageNetV2-matched-frequency/, or that folder (class folders 0..999). Reported as "
            "imagenetv2-zeroshot-val-top1/top5."
        },
    )
    zeroshot_templates: str | None = field(
        default=None,
        metadata={
            "help": "File with one prompt template per line containing '{c}' (default: OpenCLIP's ImageNet set)."
        },
    )
    force_image_size: int | None = field(
        default=None,
        metadata={
            "help": "Train at this image size (OpenCLIP's flag): the ViT is built at this size and --pretrained "
            "position embeddings of another size are resampled."
        },
    )
    image_mean: list[float] | None = field(
        default=None,
        metadata={
            "help": "Normalization mean, 3 values (R G B) or 1 for all channels (OpenCLIP's flag). "
            "Default: OpenAI CLIP's. Applies to training and evaluation images (the demo set's too).",
            "nargs": "+",
        },
    )
    image_std: list[float] | None = field(
        default=None,
        metadata={"help": "Normalization std, 3 values or 1 (OpenCLIP's flag). Default: OpenAI CLIP's.", "nargs": "+"},
    )
    image_interpolation: str = field(
        default="bicubic",
        metadata={
            "help": "Resize interpolation (OpenCLIP's flag): evaluation resizes and use_timm training crops; "
            "the plain training crop is bicubic, as in OpenCLIP.",
            "choices": INTERPOLATIONS,
        },
    )
    image_resize_mode: str = field(
        default="shortest",
        metadata={
            "help": "Evaluation resize (OpenCLIP's flag): shortest side + center crop, longest side + "
            "center crop-or-pad, or squash to the size.",
            "choices": RESIZE_MODES,
        },
    )
    aug_cfg: dict = field(
        default_factory=dict,
        metadata={
            "help": "Training augmentation as OpenCLIP's key=value pairs: scale='(0.5,1.0)', ratio, "
            "color_jitter, color_jitter_prob, gray_scale_prob, re_prob, re_count, use_timm=True (timm's "
            "create_transform; needed for ratio and random erasing).",
            "nargs": "*",
        },
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "SentencePiece model path. Default with demo data: the built-in demo tokenizer."},
    )
    demo_num_samples: int = field(default=20000, metadata={"help": "Size of the built-in demo training set."})
    demo_eval_samples: int = field(default=1000, metadata={"help": "Held-out demo images for zero-shot eval."})

    def __post_init__(self):
        # OpenCLIP's name for a zero-shot class folder laid out by WordNet id
        if self.imagenet_val and not self.zeroshot_data:
            self.zeroshot_data = self.imagenet_val
        # key=value words (command line) or a mapping (recipe) -> one checked dict, saved with the run
        self.aug_cfg = parse_aug_cfg(self.aug_cfg)

    def check(self) -> None:
        if self.dataset_type == "synthetic" and not self.train_num_samples:
            raise ConfigError("--dataset-type synthetic needs --train-num-samples (the epoch length), as OpenCLIP")
        if self.imagenet_v2 and not os.path.isdir(self.imagenet_v2):  # found out early, not after an epoch
            raise ConfigError(f"--imagenet-v2 folder not found: {self.imagenet_v2}")
        if self.imagenet_val and self.zeroshot_data != self.imagenet_val:
            raise ConfigError("give either --imagenet-val or --zeroshot-data, not both")
        if self.data_decode == "gpu" and not _cuda_available():
            raise ConfigError("--data-decode gpu needs CUDA, none found: use --data-decode cpu (the CPU path)")
        if self.min_image_size < 0 or self.max_image_size < 0:
            raise ConfigError("--min-image-size and --max-image-size are pixels (>= 0; 0 turns the limit off)")
        if self.max_image_size and self.min_image_size > self.max_image_size:
            raise ConfigError(
                f"--min-image-size {self.min_image_size} > --max-image-size {self.max_image_size}: no image can pass"
            )
        try:
            self.sample_keys()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_mean_std("image-mean", self.image_mean)
        check_mean_std("image-std", self.image_std)

    def sample_keys(self) -> SampleKeys:
        """--image-key / --text-key / --json-text-key: which webdataset members are the image and the caption."""
        return SampleKeys(self.image_key, self.text_key, self.json_text_key)

    def image_limits(self) -> ImageLimits:
        return ImageLimits(self.min_image_size, self.max_image_size)

    def preprocess_args(self) -> dict:
        """The keyword arguments of :func:`dsclip.data.transforms.image_transform` this config sets."""
        return dict(
            mean=self.image_mean,
            std=self.image_std,
            interpolation=self.image_interpolation,
            resize_mode=self.image_resize_mode,
            aug_cfg=self.aug_cfg,
        )

    def resolved_dataset_type(self) -> str:
        if self.dataset_type not in DATASET_TYPES:
            raise ValueError(f"dataset_type must be one of {DATASET_TYPES}, got {self.dataset_type!r}")
        if self.dataset_type != "auto":
            return self.dataset_type
        if not self.train_data:
            return "demo"
        if self.train_data.split("::")[0].lower().endswith((".csv", ".tsv")):
            return "csv"
        return "webdataset"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
