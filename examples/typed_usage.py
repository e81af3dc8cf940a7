"""readerlib used from typed code (checked by `mypy --strict examples/`, tests/test_typing.py).

    python examples/typed_usage.py
"""
import os
import tempfile
from typing import Any

import numpy as np
import numpy.typing as npt

import readerlib as rl


def write_file(path: str, n: int) -> rl.Schema:
    schema = rl.Schema([rl.Field("tokens", np.int32, (), lod_level=1), rl.Field("label", np.int64)])
    rng = np.random.default_rng(0)
    with rl.RecordIOWriter(path, schema) as w:
        for i in range(n):
            w.write((rng.integers(0, 1000, size=int(rng.integers(1, 20)), dtype=np.int32), np.int64(i)))
    return schema


def add_one(instance: tuple[Any, ...]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int64]]:
    tokens, label = instance
    return tokens + np.int32(1), label


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.rio")
        schema = write_file(path, 100)
        chain: rl.BatchReader = (rl.RecordIOReader(path)
                                 .shuffle(64, seed=0)
                                 .map(add_one, num_threads=2)
                                 .filter(lambda x: int(x[1]) % 10 != 0)
                                 .batch(16))
        assert chain.schema == schema
        state: dict[str, Any] = chain.get_state()
        total = 0
        with chain:
            for batch in chain:
                tokens: rl.LoDTensor = batch[0]
                lengths: npt.NDArray[np.int64] = tokens.lengths()
                total += int(lengths.shape[0])
            chain.set_state(state)
        print(f"{total} instances in batches; {rl.get_num_threads()} threads; headers at {rl.get_include()}")


if __name__ == "__main__":
    main()
