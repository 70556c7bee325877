"""The patchify and audio-row layouts (what the DiT sees)."""


import pytest
import torch
from support.contract_cases import _randn

from h3_core.contract import (
    ContractError,
    audio_latent_to_rows,
    audio_rows_to_latent,
    patchify_video_latent,
    unpatchify_video_rows,
)

# --- patchify / audio row helpers ---------------------------------------------------------------


def test_patchify_order_and_inverse():
    lat = _randn(1, 3, 2, 4, 6, seed=60)
    rows = patchify_video_latent(lat)
    assert rows.shape == (2 * 2 * 3, 12) and rows.is_contiguous()
    for t in range(2):
        for i in range(2):
            for j in range(3):
                r = (t * 2 + i) * 3 + j
                for c in range(3):
                    for p in range(2):
                        for q in range(2):
                            assert rows[r, c * 4 + p * 2 + q] == lat[0, c, t, 2 * i + p, 2 * j + q]
    assert torch.equal(unpatchify_video_rows(rows, 2, 4, 6, 3), lat)
    # same as einsum("nctrhpwq->nthwcrpq") used by ComfyUI / vLLM-Omni
    ref = torch.einsum("nctrhpwq->nthwcrpq", lat.reshape(1, 3, 2, 1, 2, 2, 3, 2)).reshape(-1, 12)
    assert torch.equal(rows, ref)
    with pytest.raises(ContractError, match="not divisible"):
        patchify_video_latent(_randn(1, 3, 1, 3, 4))
    with pytest.raises(ContractError, match="expected shape"):
        unpatchify_video_rows(rows, 2, 4, 4, 3)


def test_audio_rows_are_channel_major():
    latent = _randn(1, 32, 2, 5, seed=61)  # ComfyUI layout [1, A, 2, T]
    rows = audio_latent_to_rows(latent)
    assert rows.shape == (10, 32)
    assert torch.equal(rows[:5], latent[0, :, 0, :].T)  # channel 0, frames 0..4
    assert torch.equal(rows[5:], latent[0, :, 1, :].T)  # then channel 1
    assert torch.equal(audio_rows_to_latent(rows), latent)
    with pytest.raises(ContractError):
        audio_latent_to_rows(_randn(1, 32, 1, 5))
    with pytest.raises(ContractError):
        audio_rows_to_latent(_randn(9, 32))
