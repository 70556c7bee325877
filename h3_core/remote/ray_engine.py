"""The old import path of saved Ray Serve configs (`import_path: h3_core.remote.ray_engine:build`); still deploys.

The engine lives in `engines/ray_serve.py`; new configs name `h3_core.remote.engines.ray_serve:build`.
"""

from .engines.ray_serve import build

__all__ = ["build"]
