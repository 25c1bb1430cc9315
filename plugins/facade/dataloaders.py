"""The ``Trainer``'s data: HF's ``get_*_dataloader`` methods, the collator, and the run's length.

A mixin of ``Trainer``. Train loaders follow HF's ``train_sampling_strategy`` (length grouping) and
``remove_unused_columns``; under several processes the ``Distributed`` plugin shards them.
"""

from __future__ import annotations

import inspect
import itertools
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, SequentialSampler

from trainbus.engine import ConfigError

from ..data.collators import is_columnar, remove_columns_but
from ..data.length_grouping import eval_sampler, main_input_name_of, train_sampler
from ..data.loading import (
    FetchAheadLoader,
    RemoveColumnsCollator,
    build_dataloader,
    is_tokenizer_like,
    signature_columns,
)
from .batch_checks import CheckedCollator


class TrainerData:
    """HF's dataloader methods (a mixin of ``Trainer``)."""

    # provided by Trainer / Engine
    args: Any
    train_dataset: Any
    eval_dataset: Any
    processing_class: Any
    data_collator: Callable[[list[Any]], Any]
    label_names_arg: list[str]
    distributed: Any
    train_data: Any
    max_epochs: int | None
    max_steps: int | None
    _model_for_columns: Any
    _train_batch_size: int
    _rebuild_named_schedule: Callable[[], None]

    def _plan_length(self, loader: Any) -> tuple[int | None, int | None]:
        args = self.args
        if args.max_steps > 0:
            return None, args.max_steps
        if loader is None:
            return max(1, math.ceil(args.num_train_epochs)), None
        try:
            batches = len(loader)
        except TypeError:
            raise ConfigError(
                "the train dataset has no length (an iterable dataset): set TrainingArguments.max_steps"
            ) from None
        if float(args.num_train_epochs).is_integer():
            return int(args.num_train_epochs), None
        per_epoch = math.ceil(batches / args.gradient_accumulation_steps)
        return None, max(1, math.ceil(args.num_train_epochs * per_epoch))  # fractional epochs, as HF

    #: HF's: the batch keys the model takes (its forward's parameters and the label keys), set when first needed
    _signature_columns: list[str] | None = None

    def _set_signature_columns_if_needed(self) -> None:
        """HF's: ``_signature_columns`` from the model's forward when not set yet (a subclass may set its own)."""
        if self._signature_columns is None:
            self._signature_columns = signature_columns(self._model_for_columns, self.label_names_arg)

    def _remove_unused_columns(self, dataset: Any, description: str | None = None) -> Any:
        """HF's: a ``datasets.Dataset`` without the columns the model's forward does not take."""
        if not self.args.remove_unused_columns:
            return dataset
        self._set_signature_columns_if_needed()
        return remove_columns_but(dataset, self._signature_columns or [], self._model_for_columns)

    def _get_collator_with_removed_columns(self, data_collator: Any, description: str | None = None) -> Any:
        """HF's: the collator, dropping the keys of dict samples the model's forward does not take."""
        if not self.args.remove_unused_columns:
            return data_collator
        self._set_signature_columns_if_needed()
        return RemoveColumnsCollator(data_collator, self._signature_columns or [], self._model_for_columns)

    def _get_dataloader(
        self,
        dataset: Any,
        description: str,
        batch_size: int,
        sampler_fn: Callable[..., Any] | None = None,
        is_training: bool = False,
        dataloader_key: str | None = None,
    ) -> Any:
        """HF's: a loader of ``dataset`` (columns removed, ``sampler_fn``'s sampler); evaluation and prediction
        loaders are read one batch ahead (``FetchAheadLoader``), as accelerate reads transformers' loaders."""
        args = self.args
        sampler = None
        if sampler_fn is not None and not isinstance(dataset, IterableDataset | DataLoader):
            # lengths read before columns go; an older _get_train_sampler override takes no dataset
            takes_dataset = bool(inspect.signature(sampler_fn).parameters)
            sampler = sampler_fn(dataset) if takes_dataset else sampler_fn()
        collator = self.data_collator
        if is_columnar(dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(self.data_collator, description=description)
        loader = build_dataloader(
            dataset,
            batch_size=batch_size,
            collate_fn=CheckedCollator(collator, self.label_names_arg),  # bad samples named
            shuffle=is_training,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            drop_last=args.dataloader_drop_last,
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory and args.device.type == "cuda",
            persistent_workers=args.dataloader_persistent_workers,
            prefetch_factor=args.dataloader_prefetch_factor,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            sampler=sampler,
            loader_class=DataLoader if is_training else FetchAheadLoader,
        )
        # accelerate's prepared loaders tell the batch size over all processes (transformers' tests read it)
        loader.total_batch_size = batch_size * max(1, args.world_size)
        if dataloader_key is not None and args.dataloader_persistent_workers:
            # HF: with persistent workers an evaluation loader is made once per eval set and kept
            self._eval_dataloaders = {**getattr(self, "_eval_dataloaders", {}), dataloader_key: loader}
        return loader

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """HF's: the train set's sampler, here the length-grouped one with ``train_sampling_strategy=
        "group_by_length"``, else None (the seeded shuffle); a subclass's override is the loader's sampler."""
        args = self.args
        return train_sampler(
            self.train_dataset if train_dataset is None else train_dataset,
            str(args.train_sampling_strategy),
            seed=args.data_seed if args.data_seed is not None else args.seed,
            group_size=args.train_batch_size * args.gradient_accumulation_steps * args.world_size,
            length_column_name=args.length_column_name,
            model_input_name=main_input_name_of(self.processing_class),
        )

    def _get_eval_sampler(self, eval_dataset: Any) -> Any:
        """HF's: an eval / test set's sampler: its order (``SequentialSampler``) in one process, None under several
        (the Distributed plugin shards it); a 4.x / 5.0 length-grouped draw with ``group_by_length``."""
        if eval_dataset is None or not hasattr(eval_dataset, "__len__"):
            return None
        grouped = eval_sampler(eval_dataset, str(self.args.train_sampling_strategy))  # 4.x's draw
        if grouped is not None:
            return grouped
        return SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None

    def get_train_dataloader(self) -> Any:
        if self.train_dataset is None:
            raise ConfigError("Trainer: training requires a train_dataset")
        loader = self._get_dataloader(
            self.train_dataset, "Training", self._train_batch_size, self._get_train_sampler, is_training=True
        )
        return loader if self.distributed is None else self.distributed.shard_train(loader)

    def _use_train_batch_size(self, batch_size: int) -> None:
        """Train with this per-device batch size from now on (auto_find_batch_size)."""
        self._train_batch_size = batch_size
        self.train_data = self.get_train_dataloader()
        self.max_epochs, self.max_steps = self._plan_length(self.train_data)
        self._rebuild_named_schedule()  # for the new number of steps (HF)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """HF's: the loader of ``eval_dataset`` (a name: that set of the Trainer's dict of eval sets), else of the
        Trainer's; with persistent workers the loader made first for a name (or "eval") is kept and returned."""
        if eval_dataset is None and self.eval_dataset is None:
            raise ConfigError("Trainer: evaluation requires an eval_dataset")
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        kept = getattr(self, "_eval_dataloaders", {})
        if key in kept and self.args.dataloader_persistent_workers:
            return kept[key]
        dataset = self._named_eval_set(eval_dataset) if isinstance(eval_dataset, str) else eval_dataset
        if dataset is None:
            dataset = self.eval_dataset
        return self._get_dataloader(
            dataset, "Evaluation", self.args.eval_batch_size, self._get_eval_sampler, False, key
        )

    def _named_eval_set(self, name: str) -> Any:
        sets = self.eval_dataset
        if not isinstance(sets, Mapping) or name not in sets:
            known = sorted(sets) if isinstance(sets, Mapping) else "none (eval_dataset is not a dict)"
            raise ConfigError(f"get_eval_dataloader({name!r}): no eval set of that name; the names are {known}")
        return sets[name]

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return self._get_dataloader(test_dataset, "test", self.args.eval_batch_size, self._get_eval_sampler)

    def _eval_loaders(self, dataset: Any) -> Any:
        if isinstance(dataset, Mapping):  # HF asks for the Trainer's own sets by name
            own = dataset is self.eval_dataset
            return {name: self.get_eval_dataloader(name if own else d) for name, d in dataset.items()}
        return self.get_eval_dataloader(dataset)

    def num_examples(self, dataloader: Any) -> int:
        """Examples in a dataloader's dataset (HF)."""
        dataset = getattr(dataloader, "dataset", dataloader)
        return len(dataset)

    def num_tokens(self, train_dl: Any, max_steps: int | None = None) -> int:
        """Input tokens in ``train_dl`` (``input_ids`` elements), over at most ``max_steps`` batches."""
        batches = itertools.islice(train_dl, max_steps)
        return sum(int(b["input_ids"].numel()) for b in batches if isinstance(b, Mapping) and "input_ids" in b)


def pads_batches(processing_class: Any) -> bool:
    """Whether the default collator pads with ``processing_class`` (HF: a tokenizer or a sequence feature
    extractor; an image processor's ``pad`` is not for dict features). Without transformers: anything
    tokenizer-like."""
    if processing_class is None or "transformers" not in sys.modules:  # none of transformers' classes
        return is_tokenizer_like(processing_class)
    from transformers import PreTrainedTokenizerBase
    from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor

    return isinstance(processing_class, PreTrainedTokenizerBase | SequenceFeatureExtractor)
