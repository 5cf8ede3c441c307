"""The probe's summary of what a digit-task policy answers at one position (tools/answer_positions.py)."""

from __future__ import annotations

import torch

from stages.data.model import load_tokenizer, make_tiny_model
from tools.answer_positions import commonest


def test_commonest_names_the_answers_a_position_gives_most_with_their_share(tmp_path):
    tokenizer = load_tokenizer(make_tiny_model(tmp_path / "tiny"))
    ids = [tokenizer.encode(d, add_special_tokens=False)[0] for d in "0001127"]
    assert commonest(tokenizer, torch.tensor(ids)) == "'0' 43%, '1' 29%, '2' 14%"
    assert commonest(tokenizer, torch.tensor(ids), top=1) == "'0' 43%"
