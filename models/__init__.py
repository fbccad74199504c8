"""The bundled default model (trained by this project, see models/README.md) and how it was made.

DEFAULT_MODEL_DIR is the shipped Hugging Face directory (2B-4T packed layout); DEFAULT_STORE is the same
model already converted to the engine's weight store. Importing this package never imports torch.
"""
import os

MODEL_NAME = "bitnet-b1.58-tiny"
DEFAULT_MODEL_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), MODEL_NAME)
DEFAULT_STORE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.bnstore")
