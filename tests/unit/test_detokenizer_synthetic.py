"""Tier 1: incremental detokenization with a synthetic SentencePiece-like decoder (no model)."""
from __future__ import annotations

import random

from tests.support.detokenize import expected_output, random_splits, run


class SentencePieceLike:
    """A decoder that drops the leading space of the first piece, like SentencePiece's."""

    PIECES = ["▁Hello", "▁world", ",", "▁how", "▁are", "▁you", "?", "▁I", "'m", "▁fine", "<0xE6>", "<0x97>",
              "<0xA5>", "▁ok", "</s>"]

    def decode(self, ids, skip_special_tokens=True):
        data = b""
        for i in ids:
            piece = self.PIECES[i]
            if piece == "</s>" and skip_special_tokens:
                continue
            data += bytes([int(piece[3:5], 16)]) if piece.startswith("<0x") else piece.replace("▁", " ").encode()
        text = data.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text


def test_window_handles_sentencepiece_like_decoders():
    fake = SentencePieceLike()
    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(len(fake.PIECES)) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.5:
            ids += [10, 11, 12]  # 日 as three byte tokens
        if rng.random() < 0.5:
            ids[rng.randrange(len(ids)):0] = [14, 14, 0]  # skipped specials, then a word with its space
        full = fake.decode(ids)
        deltas, tail, _ = run(fake, ids, random_splits(ids, rng, 3), stop=["are you", "fine?"])
        want, _ = expected_output(full, ["are you", "fine?"], False)
        assert "".join(d.text for d in deltas) + tail == want
