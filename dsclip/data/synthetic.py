"""OpenCLIP's ``--dataset-type synthetic``: one fixed image and one fixed caption, for throughput tests.

As open_clip_train/data.py's ``SyntheticDataset``: a black RGB image of the model's input size, put
through the training transform for every sample (so the data path costs what a real one costs after
decoding), and the caption "Dummy caption"; ``--train-num-samples`` is the epoch length. Nothing can be
learned from it; it measures the step, not the model.
"""

from __future__ import annotations

from PIL import Image
from torch.utils.data import Dataset

from .transforms import image_transform

CAPTION = "Dummy caption"  # OpenCLIP's


class SyntheticDataset(Dataset):
    def __init__(self, num_samples: int, image_size: int, transform):
        self.num_samples, self.transform = num_samples, transform
        self.image = Image.new("RGB", (image_size, image_size))  # black, as OpenCLIP's

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int):
        return self.transform(self.image), CAPTION


def synthetic_train_dataset(data_cfg, image_size: int) -> tuple[SyntheticDataset, str]:
    """OpenCLIP's synthetic training set and its name in logs (the loader is built by build_train_data)."""
    if not data_cfg.train_num_samples:
        raise ValueError("--dataset-type synthetic needs --train-num-samples (the epoch length), as OpenCLIP")
    transform = image_transform(image_size, is_train=True, **data_cfg.preprocess_args())
    return SyntheticDataset(data_cfg.train_num_samples, image_size, transform), "synthetic data"
