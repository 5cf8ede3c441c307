"""Splitting a learner step's work by tokens: whole groups over the ranks, then one rank's rows into
micro-batches. Pure and deterministic: every rank computes the same answer from the same counts.

`balance_groups(tokens, world_size)` assigns whole groups (a group's advantages are computed over the
group, so it never straddles ranks) to ranks by greedy LPT: the largest group first, each to the rank
with the fewest tokens so far (ties: the rank with fewer groups, then the lowest rank). Its largest
load is at most (4/3 - 1/(3 * world_size)) times the best possible (Graham's bound). When there are
at least as many groups as ranks every rank gets one or more; when there are fewer, the ranks left
over get none and still take part in the step with an empty batch (their loss contributes 0 and the
loss is normalised by the step's global token count, so the gradient equals one rank's).

`micro_batches(tokens, max_tokens)` packs one rank's rows into micro-batches whose padded size (rows x
the longest row: what a padded forward pass holds) is at most `max_tokens`, first fit over the rows
largest first (so a micro-batch's rows are of like length and little is padding); a row larger than the
budget is alone in its micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence


def balance_groups(tokens: Sequence[int], world_size: int) -> list[list[int]]:
    """Group indexes per rank (each list ascending), every group on exactly one rank."""
    if world_size < 1:
        raise ValueError(f"world_size is {world_size}; it must be at least 1")
    if any(t < 0 for t in tokens):
        raise ValueError(f"token counts must not be negative: {list(tokens)}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], len(shares[r]), r))
        shares[rank].append(i)
        load[rank] += tokens[i]
    return [sorted(share) for share in shares]


def loads(tokens: Sequence[int], shares: Sequence[Sequence[int]]) -> list[int]:
    """Tokens per rank under `shares`."""
    return [sum(tokens[i] for i in share) for share in shares]


def micro_batches(tokens: Sequence[int], max_tokens: int | None) -> list[list[int]]:
    """Row indexes per micro-batch (each list ascending; micro-batches ordered by their first row), each of
    padded size (rows x its longest row) within `max_tokens` unless it is a single row larger than that.
    None: one micro-batch of every row."""
    if max_tokens is None:
        return [list(range(len(tokens)))] if len(tokens) else []
    if max_tokens < 1:
        raise ValueError(f"max_tokens is {max_tokens}; it must be at least 1")
    batches: list[list[int]] = []
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], i)):
        # rows come longest first, so a micro-batch's first row is its longest
        fit = next((b for b in batches if (len(b) + 1) * tokens[b[0]] <= max_tokens), None)
        if fit is None:
            batches.append([i])
        else:
            fit.append(i)
    return sorted((sorted(b) for b in batches), key=lambda b: b[0])
