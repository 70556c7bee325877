"""Thin ComfyUI V3 adapters over h3_core: ComfyUI types in, h3_core calls, ComfyUI types out."""

from comfy_api.latest import ComfyExtension, io


class H3Extension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        # The node modules register here as they land (loaders, encode, remote, sample, decode,
        # conditioning_io); see the nodes issue.
        return []
