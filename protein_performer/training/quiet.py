"""Library lines that are not the user's business, silenced one by one (never a blanket
filter): Lightning's product tips; its notices that ``limit_val_batches=1.0`` uses 100 % of
the batches, that ``val_check_interval=1.0`` validates at each epoch's end, and that it loads
the training loader to count the steps (finetune's schedule asks it to); a torch deprecation
raised inside Lightning's own code (``LeafSpec``); and the non-empty checkpoint folder warning
(training checks its folder itself: :mod:`protein_performer.training.run_folder`)."""
from __future__ import annotations

import logging
import warnings

DROPPED_LOG_LINES = ("💡 Tip:", "was configured so 100% of the batches",
                     "was configured so validation will run at the end of the training epoch",
                     "to estimate number of stepping batches")
LIGHTNING_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero")


class _DropLines(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(s in message for s in DROPPED_LOG_LINES)


def quiet_libraries() -> None:
    """Install the filters (idempotent)."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLines) for f in logger.filters):
            logger.addFilter(_DropLines())
