"""What the test modules share, so that no test module imports another (tests/test_layout.py checks it).

Harnesses: `comfy_harness` (a real ComfyUI server per session), `comfy_pack` (module fixtures: the pack's
ComfyUI server and an encoder endpoint), `comfy_lowvram_probe` (a test-only ComfyUI extension, copied into a
server's custom_nodes by path), `encoder_process` (`python -m h3_core serve` as a real process), `service_support`
(the encode service), `hostile_peer` (a hostile encoder endpoint for client tests).
Cases and helpers: `remote_cases` (parity requests by task, slowed stages, hostile requests), `remote_http` (raw
HTTP on loopback), `contract_cases`, `weights_support`, `quant_support`, `lora_support`, `h3_reference` (diffusers'
monolithic pipeline as the parity reference).
"""
