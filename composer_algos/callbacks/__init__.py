"""Composer callbacks and logger destinations the recipes use beside the selection algorithm.

- `train_budget.py`: `TrainTimeBudget`, stop once a wall-clock budget of training time is spent.
- `answer_accuracy.py`: `AnswerAccuracy`, exact-match accuracy of greedy answers at the end of training.
- `eval_history.py`: `EvalHistory`, every per-domain evaluation to CSV and JSON.
- `file_logger.py`: `AppendFileLogger`, Composer's FileLogger appending on autoresume.

The domain-mixture callback lives with the algorithm (`composer_algos.data_selection.MixtureMonitor`).
"""

from composer_algos.callbacks.answer_accuracy import AnswerAccuracy
from composer_algos.callbacks.eval_history import EvalHistory
from composer_algos.callbacks.file_logger import AppendFileLogger
from composer_algos.callbacks.train_budget import TrainTimeBudget

__all__ = ["AnswerAccuracy", "AppendFileLogger", "EvalHistory", "TrainTimeBudget"]
