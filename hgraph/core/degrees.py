"""A pipeline's parallel degrees, their one string form and their one parser.

``Degrees(tp, pp, cp, vpp=, ep=)`` is what a pipeline is apart from its ranks (``hgraph.core.strategy.
Pipeline`` is degrees plus ranks) and what the planner costs (a cost table's scheme is a ``Degrees``
with ``vpp = 1``). The string form is the strategy syntax of the README: ``tp`` first and always, then
``ep``, ``pp``, ``vpp``, ``cp`` where they are above 1, joined by commas (``"tp2,pp2"``, ``"tp4,ep4"``,
``"tp1,pp2,vpp2"``, ``"tp8,cp2"``). ``parse_degrees`` reads any order, degrees of 1 written or not
(``"tp1,pp1"``, the form cost tables and profiles used to print, reads as ``"tp1"``) and a surrounding
``(...)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Sequence, Union

from hgraph.errors import StrategyError

DEGREES = ("tp", "pp", "cp", "vpp", "ep")
_PRINTED = ("tp", "ep", "pp", "vpp", "cp")  # the order ``str`` writes them in


@dataclass(frozen=True, order=True)
class Degrees:
    """One pipeline's parallel degrees (see the module docstring for the string form).

    Inside a pipeline rank order is stage-major, then cp, then tp (``hgraph.core.strategy``); with
    ``ep > 1`` a stage's ``cp x tp`` ranks are an expert mesh ``(ep, etp)``, ``etp = cp·tp / ep``."""

    tp: int = 1
    """Tensor-parallel degree: ranks that split each layer's weights (a run of consecutive ranks)."""
    pp: int = 1
    """Pipeline-parallel degree: stages the layers are cut into."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence (ring attention)."""
    vpp: int = field(default=1, kw_only=True)
    """Virtual stages per stage (interleaved 1F1B when > 1; needs ``pp >= 2``): stage ``s`` holds the
    chunks ``s, s + pp, ...`` of the ``pp * vpp`` virtual stages."""
    ep: int = field(default=1, kw_only=True)
    """Expert-parallel degree: groups the routed experts of a mixture-of-experts layer are split into
    over a stage's ``cp x tp`` ranks (must divide ``cp·tp``)."""

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for name in DEGREES:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise StrategyError(f"{kind} {name}={value!r}; every degree must be an integer >= 1")
        if self.vpp > 1 and self.pp < 2:
            raise StrategyError(f"{kind} vpp={self.vpp} needs pp >= 2 (interleaving chunks over stages); "
                                f"got pp={self.pp}")
        if (self.cp * self.tp) % self.ep:
            raise StrategyError(
                f"{kind} ep={self.ep} does not divide the stage mesh cp*tp={self.cp * self.tp} "
                f"(cp={self.cp}, tp={self.tp}); use an ep dividing {self.cp * self.tp}"
            )

    @staticmethod
    def parse(text: str) -> Degrees:
        """The degrees ``text`` writes (``parse_degrees``); raises ``StrategyError`` naming the token."""
        degrees = parse_degrees(text)
        if isinstance(degrees, str):
            raise StrategyError(f"cannot parse degrees {degrees!r} in {text!r}; write e.g. 'tp2,pp4', "
                                "'tp4,cp2', 'tp4,ep4' or 'tp1,pp2,vpp2'")
        return Degrees(degrees["tp"], degrees["pp"], degrees["cp"], vpp=degrees["vpp"], ep=degrees["ep"])

    @staticmethod
    def of(value: Any) -> Degrees:
        """The degrees of anything with ``tp``/``pp``/``cp`` (and ``vpp``, ``ep``) attributes."""
        return Degrees(value.tp, value.pp, getattr(value, "cp", 1), vpp=getattr(value, "vpp", 1),
                       ep=getattr(value, "ep", 1))

    @property
    def degrees(self) -> Degrees:
        """These degrees alone (of a ``Pipeline``: without its ranks)."""
        return Degrees.of(self)

    @property
    def size(self) -> int:
        """Ranks (GPUs) one pipeline of these degrees uses: ``tp * pp * cp``."""
        return self.tp * self.pp * self.cp

    @property
    def stage_mesh(self) -> tuple[int, int]:
        """Mesh shape of one stage: ``(cp, tp)``."""
        return (self.cp, self.tp)

    @property
    def expert_mesh(self) -> tuple[int, int]:
        """The stage's ranks as the experts see them: ``(ep, etp)``, ``etp = cp·tp / ep``."""
        return (self.ep, self.cp * self.tp // self.ep)

    @property
    def program_key(self) -> tuple[int, int, int]:
        """``(cp, tp, ep)``: pipelines with equal keys run the same local program."""
        return (self.cp, self.tp, self.ep)

    @property
    def stage_key(self) -> Degrees:
        """These degrees with ``vpp = 1``: pipelines with equal keys have stages of equal cost and
        memory (the planner's scheme, the key of a cost table; interleaving changes the bubble only)."""
        return Degrees(self.tp, self.pp, self.cp, ep=self.ep)

    def __str__(self) -> str:
        """The strategy syntax: ``tp2,pp2`` (tp always, the others where above 1; module docstring)."""
        return ",".join(f"{name}{getattr(self, name)}" for name in _PRINTED
                        if name == "tp" or getattr(self, name) > 1)


def parse_degrees(text: str, names: Sequence[str] = DEGREES) -> Union[dict[str, int], str]:
    """The one parser of a pipeline's degrees, written ``tp2,pp2`` (``(tp2,pp2)`` is read too): every
    name of ``names`` -> its degree (omitted: 1), or the token it cannot read (callers name it in their
    own error). A degree named twice (``tp2,tp4``) raises ``StrategyError``."""
    degrees = dict.fromkeys(names, 1)
    named: dict[str, str] = {}
    pattern = re.compile(rf"({'|'.join(sorted(names, key=len, reverse=True))})(\d+)")
    for token in filter(None, (t.strip() for t in text.strip().strip("()").split(","))):
        m = pattern.fullmatch(token)
        if not m:
            return token
        if m.group(1) in named:
            raise StrategyError(f"degree {m.group(1)} is named twice in {text!r} ({named[m.group(1)]} and {token}); "
                                "name each degree once, e.g. 'tp2,pp2'")
        named[m.group(1)] = token
        degrees[m.group(1)] = int(m.group(2))
    return degrees
