"""Test-only ComfyUI extension (copied into a test server's custom_nodes/ by tests/test_sequence_parallel_comfyui.py).

ComfyUI core's SaveLatent cannot save the H3 AV latent (a NestedTensor of video and audio), so `H3ProbeSaveAVLatent`
writes its two tensors as they are to output/<name>.safetensors, for the test to compare them exactly.
"""

from __future__ import annotations

import os

import folder_paths
from safetensors.torch import save_file


class SaveAVLatent:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"latent": ("LATENT",), "name": ("STRING", {"default": "latent"})}}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "_for_testing"

    def save(self, latent, name):
        video, audio = latent["samples"].tensors
        path = os.path.join(folder_paths.get_output_directory(), f"{name}.safetensors")
        save_file({"video": video.contiguous(), "audio": audio.contiguous()}, path)
        return {"ui": {"h3_latent": [name]}}


NODE_CLASS_MAPPINGS = {"H3ProbeSaveAVLatent": SaveAVLatent}
