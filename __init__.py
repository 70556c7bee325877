"""MiniMax H3 node pack for ComfyUI (V3 API).

Only `comfy_entrypoint` is exported: a `NODE_CLASS_MAPPINGS` here would make ComfyUI ignore the V3
entry point. The import of ComfyUI's API is deferred to the call, so `h3_core` (the CLI, the
encoder server) and the test-suite never import ComfyUI through this file.

`WEB_DIRECTORY` serves web/ (the Save / Load Conditioning canvas helpers: the saved file's name, an upload
button; the tiny-H3 badge; run-time error dialogs titled with display names); it is a plain string, so importing
this file still imports nothing from ComfyUI.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import H3Extension

    return H3Extension()
