"""The train options model lives in the config layer (astrai.config.train) so that loading a recipe
never imports torch; this is its home for users of the Python API."""

from astrai.config.train import TrainOptions

__all__ = ["TrainOptions"]
