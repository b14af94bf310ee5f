"""Public math datasets -> the trainer's prompt schema (logic in megatron_dapo/data/prepare.py).

    python tools/prepare_data.py --source {dapo-math-17k,aime2024,gsm8k,math} --input FILE --out OUT.parquet
"""

import sys

from megatron_dapo.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
