"""The console progress bar: step, reward, accuracy, tokens/s."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", disable=not enabled,
                        file=sys.stderr, dynamic_ncols=True)

    def update(self, step: int, m: dict[str, float]) -> None:
        self.bar.n = step
        self.bar.set_postfix_str(
            f"reward {m.get('reward', float('nan')):.3f} acc {m.get('accuracy', float('nan')):.3f} "
            f"tok/s {m.get('tokens_per_s', 0):.0f}"
            + (f" eval {m['eval/accuracy']:.3f}" if "eval/accuracy" in m else ""),
            refresh=True,
        )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.bar.close()
