"""FFN's field-of-view movement rule, shared by training and inference.

After the network updates the object mask in a FOV, the FOV may move by `deltas` along one axis
toward a face of the central (2*delta + 1) box where the object is predicted with probability
above the move threshold; it moves to the most probable voxel of that face (google-research/ffn
`movement.get_scored_move_offsets`).
"""

from collections.abc import Sequence

import numpy as np

Face = tuple[int, int]  # (axis, -1 or +1)
Move = tuple[float, tuple[int, int, int]]  # (score, offset zyx)


def face_moves(
    logits: np.ndarray, deltas_zyx: Sequence[int], threshold_logit: float
) -> dict[Face, Move]:
    """Per face of the central (2*delta + 1) box whose best logit is >= threshold, the move to
    that best voxel: (score, offset zyx). `logits` is one FOV's object mask (z, y, x); offsets are
    relative to its centre."""
    center = np.array(logits.shape) // 2
    box = [slice(c - d, c + d + 1) for c, d in zip(center, deltas_zyx, strict=True)]
    moves = {}
    for axis, delta in enumerate(deltas_zyx):
        if delta == 0:
            continue
        for sign in (-1, 1):
            face_sel = list(box)
            face_sel[axis] = center[axis] + sign * delta
            face = logits[tuple(face_sel)]
            best = np.unravel_index(int(np.argmax(face)), face.shape)
            score = float(face[best])
            if score < threshold_logit:
                continue
            offset = [int(p - s // 2) for p, s in zip(best, face.shape, strict=True)]
            offset.insert(axis, sign * delta)
            moves[(axis, sign)] = (score, tuple(offset))
    return moves


def scored_move_offsets(
    logits: np.ndarray, deltas_zyx: Sequence[int], threshold_logit: float
) -> list[Move]:
    """(score, offset zyx) of every face whose best logit is >= threshold, best first."""
    return sorted(face_moves(logits, deltas_zyx, threshold_logit).values(), reverse=True)
