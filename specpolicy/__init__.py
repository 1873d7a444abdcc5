"""specpolicy: learned, load-aware speculation policies for speculative decoding."""

import os

from omegaconf import OmegaConf

from specpolicy.errors import SpecPolicyError

# conf/paths: `paths.checkpoints_dir=~/ckpts` is the home folder's, as in a shell (Hydra's run folder and the stages
# took the `~` literally: a folder named `~` in the working directory, and a rename between the two that failed)
OmegaConf.register_new_resolver("expanduser", os.path.expanduser, replace=True)

__all__ = ["SpecPolicyError"]
