"""Joining :meth:`memguard.Guard.infer`'s per-micro-batch outputs into what
the unsplit call returns.

How many micro-batches run depends on memory, so a join that is right for
some splits only makes a metric change with load. A leaf of the output
joins by itself only where it holds one value per sample:

* a tensor whose dim 0 is its micro-batch's size: concatenated along dim 0;
* a list as long as its micro-batch (names, one dict per image): the lists
  concatenated;
* ``None`` in every micro-batch: ``None``.

Tuples (named ones too), mappings, dataclasses and lists of another length
are structure, joined place by place; they must have the same keys or length
in every micro-batch (a tuple is never taken for one value per sample, so
structure is best returned as one). Any other leaf (a 0-d tensor, a tensor
whose dim 0 is not the micro-batch's size, a number, a string, ``None`` in
some micro-batches only) needs a rule in ``combine``, or is refused with a
``TypeError`` naming where it is (``out['acc']``).

``combine`` is shaped like the output, as far down as the leaves that need
a rule: a dict for a mapping or a dataclass (keys or field names), a list or
tuple as long as a tuple or list (``None`` where no rule is needed), a rule
for a leaf. A rule is

* ``"cat"``: tensors along dim 0, lists one after the other (the unsplit
  value of a variable-length output such as detected boxes);
* ``"sum"``: tensors (of one shape) or numbers added (counts, a confusion
  matrix);
* ``"mean"``: tensors or numbers averaged, weighted by micro-batch size (the
  unsplit value where each micro-batch returns a mean over its samples);
* a callable ``rule(values, sizes)``: the values at its place, one per
  micro-batch, and the micro-batches' sample counts, in; the joined value out.

A string rule on a container applies to each leaf beneath it; a callable
gets the containers. A rule wins over the shape: give one to a leaf that is
not per-sample even where its dim 0 may equal the micro-batch's size (a
confusion matrix of 4 classes over micro-batches of 4).

The output of a batch run whole is returned as it is, but checked the same
way, so that a function whose output cannot be joined is refused at its
first call, not on the day memory first runs short.
"""
from __future__ import annotations

import dataclasses
import functools
import numbers
import operator
from collections.abc import Mapping
from typing import Any

import torch

from memguard.train.batch import _rebuild

RULES = ("cat", "sum", "mean")
_RULE_FORMS = "'cat', 'sum', 'mean' (weighted by micro-batch size) or a callable(values, sizes)"


def check_combine(combine: Any, where: str = "combine") -> None:
    """Refuse a ``combine`` that holds anything but rules, before any
    micro-batch runs.

    Raises:
        ValueError: an unknown rule name, naming where it is.
        TypeError: something that is neither rule nor container of rules.
    """
    if combine is None or callable(combine):
        return
    if isinstance(combine, str):
        if combine not in RULES:
            raise ValueError(f"{where} is {combine!r}: a rule is {_RULE_FORMS}")
    elif isinstance(combine, Mapping):
        for k, v in combine.items():
            check_combine(v, f"{where}[{k!r}]")
    elif isinstance(combine, (list, tuple)):
        for i, v in enumerate(combine):
            check_combine(v, f"{where}[{i}]")
    else:
        raise TypeError(f"{where} is {_a(combine)}: combine= holds rules "
                        f"({_RULE_FORMS}) in dicts, lists or tuples shaped like the output")


def join(parts: list, sizes: list[int], combine: Any = None) -> Any:
    """The outputs ``parts`` of micro-batches of ``sizes`` samples, joined as
    the unsplit call returns them; one part is returned as it is, once
    checked; no part (a batch of no samples) is ``None``.

    Raises:
        TypeError: a leaf that is not per-sample and has no rule, or that
            its rule cannot join, naming its place and how to fix it.
        ValueError: ``combine`` has a rule for a place the output lacks.
    """
    if not parts:
        return None
    joined = _join(parts, sizes, combine, "out")
    return parts[0] if len(parts) == 1 else joined


def _join(values: list, sizes: list[int], rule: Any, path: str) -> Any:
    """The values at ``path``, one per micro-batch, joined."""
    if callable(rule):
        return values[0] if len(values) == 1 else rule(values, sizes)
    _same_kind(values, path)
    first = values[0]
    if isinstance(rule, str) and (not _is_structure(first) or
                                  (rule == "cat" and isinstance(first, list))):
        return _apply(rule, values, sizes, path)
    if isinstance(first, Mapping):
        return _join_mapping(values, sizes, rule, path)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return _join_dataclass(values, sizes, rule, path)
    if isinstance(first, list) and rule is None and _per_sample_list(values, sizes, path):
        return [v for part in values for v in part]
    if isinstance(first, (list, tuple)):
        return _join_sequence(values, sizes, rule, path)
    if rule is not None:
        raise TypeError(f"combine has {_a(rule)} at {path}'s place, where the "
                        f"output is {_a(first)}: give it a rule ({_RULE_FORMS})")
    return _per_sample_leaf(values, sizes, path)


def _is_structure(x: Any) -> bool:
    return isinstance(x, (Mapping, list, tuple)) or (
        dataclasses.is_dataclass(x) and not isinstance(x, type))


def _kind(x: Any) -> str:
    if x is None or isinstance(x, torch.Tensor):
        return _a(x)
    if isinstance(x, numbers.Number):
        return "a number"
    return "a mapping" if isinstance(x, Mapping) else _a(x)


def _a(x: Any) -> str:
    """``x``'s type with its article: "an int", "a Tensor", "None"."""
    if x is None:
        return "None"
    name = type(x).__name__
    return f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"


def _same_kind(values: list, path: str) -> None:
    """Refuse values of different kinds at one place (a tensor in some
    micro-batches and ``None`` in others)."""
    kinds = list(dict.fromkeys(_kind(v) for v in values))
    if len(kinds) > 1:
        raise TypeError(f"{path} is {kinds[0]} in some micro-batches and {kinds[1]} in "
                        f"others: memguard cannot join them as one call over the whole batch "
                        f"would return them; return the same kind from every call")


def _refuse(path: str, what: str) -> TypeError:
    return TypeError(
        f"{path} is {what}, not one value per sample: joined across micro-batches its value "
        f"would depend on how memory split the batch. Return one value per sample (a tensor "
        f"whose dim 0 is the micro-batch's size), or pass combine= with a rule at {path}'s "
        f"place: {_RULE_FORMS}")


def _per_sample_leaf(values: list, sizes: list[int], path: str) -> Any:
    """A leaf with no rule: tensors with a batch dimension concatenated,
    ``None`` kept, anything else refused."""
    first = values[0]
    if first is None:
        return None
    if not isinstance(first, torch.Tensor):
        raise _refuse(path, _a(first))
    for v, m in zip(values, sizes):
        if v.dim() == 0:
            raise _refuse(path, "a 0-d tensor")
        if v.shape[0] != m:
            raise _refuse(path, f"a tensor of shape {tuple(v.shape)} in a micro-batch of {m} "
                                f"samples")
    return first if len(values) == 1 else torch.cat(values)


def _per_sample_list(values: list, sizes: list[int], path: str) -> bool:
    """Whether lists at ``path`` hold one value per sample (each as long as
    its micro-batch); a list of tensors whose dim 0 is that length too is
    refused (one tensor per sample, or batched tensors?)."""
    if not all(len(v) == m for v, m in zip(values, sizes)):
        return False
    for v in values:
        if len(v) > 1 and all(isinstance(t, torch.Tensor) and t.dim() > 0 and
                              t.shape[0] == len(v) for t in v):
            raise TypeError(
                f"{path} is a list of {len(v)} tensors whose dim 0 is also {len(v)}: memguard "
                f"cannot tell one tensor per sample from batched tensors. Return batched "
                f"tensors as a tuple, or pass combine= with 'cat' at {path}'s place to join "
                f"the lists as one value per sample")
    return True


def _apply(rule: str, values: list, sizes: list[int], path: str) -> Any:
    """A string rule on the leaves at ``path``."""
    if rule == "cat":
        return _cat(values, path)
    if not all(isinstance(v, (torch.Tensor, numbers.Number)) for v in values):
        raise TypeError(f"{path} is {_a(values[0])}: {rule!r} adds tensors or numbers; give "
                        f"it a callable(values, sizes) in combine= instead")
    shapes = {tuple(v.shape) for v in values if isinstance(v, torch.Tensor)}
    if len(shapes) > 1:
        raise TypeError(f"{path} has shapes {sorted(shapes)} across micro-batches: {rule!r} "
                        f"adds tensors of one shape")
    if len(values) == 1:
        return values[0]
    if rule == "sum":
        return functools.reduce(operator.add, values)
    weighted = [v * m for v, m in zip(values, sizes)]
    return functools.reduce(operator.add, weighted) / sum(sizes)


def _cat(values: list, path: str) -> Any:
    """``"cat"``: tensors of one dimension or more along dim 0, lists one
    after the other."""
    if all(isinstance(v, list) for v in values):
        return values[0] if len(values) == 1 else [x for v in values for x in v]
    if not all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
        what = "a 0-d tensor" if isinstance(values[0], torch.Tensor) else _a(values[0])
        raise TypeError(f"{path} is {what}: 'cat' joins tensors along dim 0 or lists; give it "
                        f"'sum', 'mean' or a callable(values, sizes) in combine= instead")
    return values[0] if len(values) == 1 else torch.cat(values)


def _rules_for(rule: Any, places: list, path: str, mapping: bool) -> list:
    """The rule for each place (key, field or index) of the container at
    ``path``: a string rule applies beneath it; a container of rules gives
    its own entries, for places the output has.

    Raises:
        TypeError: a container of rules of the wrong kind for the output's.
        ValueError: a rule for a place the output does not have.
    """
    if rule is None or isinstance(rule, str):
        return [rule] * len(places)
    if mapping and isinstance(rule, Mapping):
        missing = [k for k in rule if k not in places]
        if missing:
            raise ValueError(f"combine has a rule for {path}[{missing[0]!r}], which the output "
                             f"does not have ({path} holds {places})")
        return [rule.get(k) for k in places]
    if not mapping and isinstance(rule, (list, tuple)):
        if len(rule) != len(places):
            raise ValueError(f"combine has {len(rule)} rules at {path}'s place, where the "
                             f"output holds {len(places)} values")
        return list(rule)
    raise TypeError(f"combine has {_a(rule)} at {path}'s place, where the output "
                    f"is {'a mapping or dataclass' if mapping else 'a tuple or list'}: use a "
                    f"dict for a mapping or dataclass, a list or tuple for a tuple or list")


def _join_mapping(values: list, sizes: list[int], rule: Any, path: str) -> Any:
    first = values[0]
    keys = list(first)
    for v in values[1:]:
        if set(v) != set(keys):
            raise TypeError(f"{path} has keys {keys} in one micro-batch and {list(v)} in "
                            f"another: return the same keys from every call")
    rules = _rules_for(rule, keys, path, mapping=True)
    joined = {k: _join([v[k] for v in values], sizes, r, f"{path}[{k!r}]")
              for k, r in zip(keys, rules)}
    if type(first) is dict:
        return joined
    try:
        return type(first)(joined)
    except TypeError:
        return joined


def _join_dataclass(values: list, sizes: list[int], rule: Any, path: str) -> Any:
    names = [f.name for f in dataclasses.fields(values[0]) if f.init]
    rules = _rules_for(rule, names, path, mapping=True)
    return dataclasses.replace(values[0], **{
        n: _join([getattr(v, n) for v in values], sizes, r, f"{path}.{n}")
        for n, r in zip(names, rules)})


def _join_sequence(values: list, sizes: list[int], rule: Any, path: str) -> Any:
    lengths = [len(v) for v in values]
    if len(set(lengths)) > 1:
        why = ("neither one value per sample nor the same structure in every call"
               if rule is None else f"{rule!r} applies place by place, to lists of one length")
        raise TypeError(f"{path} holds {lengths} values in micro-batches of {sizes} samples: "
                        f"{why}")
    rules = _rules_for(rule, list(range(lengths[0])), path, mapping=False)
    return _rebuild(values[0], [_join([v[i] for v in values], sizes, r, f"{path}[{i}]")
                                for i, r in enumerate(rules)])
