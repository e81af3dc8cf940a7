"""Write the TFRecord test files with TensorFlow's own writer.

    python tests/data/make_tfrecord.py       # needs tensorflow (tensorflow-cpu)

Outputs next to this script (committed, so the tests need no TensorFlow):
    tf_written.tfrecord        uncompressed
    tf_written.tfrecord.gz     GZIP
    tf_written.tfrecord.zlib   ZLIB
The records are `tf_records()`: seeded byte strings of lengths 0..300, shared
with tests/formats/test_tfrecord.py, which regenerates them to compare.
"""
import os

import numpy as np


def tf_records():
    rng = np.random.default_rng(20261130)
    lengths = [0, 1, 7, 8, 64, 255, 300] + rng.integers(0, 300, size=25).tolist()
    return [rng.integers(0, 256, size=n, dtype=np.uint8).tobytes() for n in lengths]


def main():
    import tensorflow as tf

    here = os.path.dirname(os.path.abspath(__file__))
    for name, comp in [("tf_written.tfrecord", None), ("tf_written.tfrecord.gz", "GZIP"),
                       ("tf_written.tfrecord.zlib", "ZLIB")]:
        with tf.io.TFRecordWriter(os.path.join(here, name), options=comp) as w:
            for r in tf_records():
                w.write(r)
        print("wrote", name, tf.__version__)


if __name__ == "__main__":
    main()
