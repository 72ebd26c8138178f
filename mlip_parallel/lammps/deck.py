"""Reading a LAMMPS deck (its logical commands, its ``fix external``, the model a model family reads from its own
pair style) and running it with the bridge: the commands up to the fix (or, with ``--add-fix``, up to the box),
then the bridge, then the rest as a file (loops, jumps and includes work there)."""
from __future__ import annotations

import os
import shlex
import tempfile
from typing import NamedTuple

from potentials.families import ModelSpecError, families

from ..errors import LammpsBridgeError
from .bridge import PROG, SCRATCH, Bridge

ADDED_FIX_ID = "mlip_external"


def _logical_commands(lines) -> list:
    """[(first line, last line, text)]: LAMMPS commands with '&' continuations and triple quotes joined."""
    commands, i = [], 0
    while i < len(lines):
        start, text = i, lines[i]
        while i + 1 < len(lines) and (text.rstrip().endswith("&") or text.count('"""') % 2 == 1):
            if text.rstrip().endswith("&") and text.count('"""') % 2 == 0:
                text = text.rstrip()[:-1] + " " + lines[i + 1].lstrip()
            else:
                text = text + "\n" + lines[i + 1]
            i += 1
        commands.append((start, i, text))
        i += 1
    return commands


def _words(text: str) -> list:
    """The words of a command, comments dropped (a '#' outside quotes starts one)."""
    quote, out = None, []
    for ch in text:
        if quote is None and ch == "#":
            break
        if ch in "'\"":
            quote = None if quote == ch else (ch if quote is None else quote)
        out.append(ch)
    text = "".join(out)
    try:
        return shlex.split(text, posix=True)
    except ValueError:
        return text.split()


def find_external_fix(lines):
    """(index of the command, fix ID) of the deck's first ``fix ID GROUP external ...``, or None.
    LammpsBridgeError when that fix is not ``all external pf/callback 1 1``."""
    for index, (_, _, text) in enumerate(_logical_commands(lines)):
        words = _words(text)
        if len(words) >= 4 and words[0] == "fix" and words[3] == "external":
            fix_id, group, args = words[1], words[2], words[4:]
            if args[:1] != ["pf/callback"]:
                raise LammpsBridgeError(f"fix {fix_id} external must use pf/callback (the model is called back), "
                                        f"got: {' '.join(words)}")
            if args[1:] != ["1", "1"]:
                raise LammpsBridgeError(f"fix {fix_id} external must be pf/callback 1 1 (forces from the model "
                                        f"at every step), got: {' '.join(words)}")
            if group != "all":
                raise LammpsBridgeError(f"fix {fix_id} external must act on group all (the model's forces act on "
                                        f"every atom), got group {group!r}")
            return index, fix_id
    return None


class DeckModel(NamedTuple):
    """A model named by a deck's own pair style (a model family's ``lammps_deck``): its spec, the elements of the
    types, and the deck's lines with the commands it replaces blanked (line numbers kept)."""

    model: str
    elements: list
    lines: list


def deck_model(deck_path, lines) -> "DeckModel | None":
    """The model a deck names in its own pair style, as a model family translates it (a MACE user's ``pair_style
    mace`` / ``pair_style mliap unified``); None when no family's translator takes the deck. LammpsBridgeError when
    one takes it but cannot run it."""
    commands = [(start, end, _words(text)) for start, end, text in _logical_commands(lines)]
    for record in families().values():
        if record.lammps_deck is None:
            continue
        try:
            found = record.lammps_deck(str(deck_path), commands)
        except ModelSpecError as exc:
            raise LammpsBridgeError(str(exc)) from None
        if found is not None:
            blanked = list(lines)
            for index in found.dropped:
                start, end, _ = commands[index]
                blanked[start:end + 1] = [""] * (end + 1 - start)
            return DeckModel(found.model, list(found.elements), blanked)
    return None


def run_deck(lmp, deck_path, lines, model, elements, mode, skin, add_fix, memory_budget_gb=None,
             verify: bool = False) -> "Bridge":
    """Run the deck's commands up to its fix external (or, with ``add_fix``, up to the command that
    defines the box, then add the fix), attach the bridge, then run the rest as a file (loops, jumps,
    includes work there; its line numbers are the deck's). Returns the bridge."""
    commands = _logical_commands(lines)
    found = None if add_fix else find_external_fix(lines)
    fix_id = ADDED_FIX_ID if add_fix else found[1]
    split = None
    for index, (start, end, text) in enumerate(commands):
        words = _words(text)
        if words[:1] == ["jump"]:
            raise LammpsBridgeError(f"{deck_path}:{start + 1}: a jump before the fix external is defined is not "
                                    f"supported; define the box and the fix first")
        if words:
            lmp.command(text)
        if add_fix and lmp.extract_setting("box_exist"):
            lmp.command(f"fix {fix_id} all external pf/callback 1 1")
            split = end
            break
        if not add_fix and index == found[0]:
            if not lmp.has_id("fix", lmp.expand(fix_id) if "$" in fix_id else fix_id):
                raise LammpsBridgeError(f"{deck_path}:{start + 1}: this command did not define fix {fix_id}")
            fix_id = lmp.expand(fix_id) if "$" in fix_id else fix_id
            split = end
            break
    if split is None:
        raise LammpsBridgeError(f"{deck_path}: the deck defines no simulation box (create_box, read_data or "
                                f"read_restart) at its top level, so --add-fix has nowhere to add the fix")
    bridge = Bridge(lmp, model, fix_id, elements=elements, mode=mode, skin=skin, memory_budget_gb=memory_budget_gb,
                    verify=verify)
    species = "any element" if model.species is None else " ".join(model.species) if len(model.species) <= 8 \
        else f"{len(model.species)} elements"
    lmp.command(f'print "{PROG}: fix {fix_id} external: {type(model).__name__} ({species}; cutoff '
                f'{model.cutoff:g} A, {model.layers} layer(s)), {mode} halo, skin {skin:g} A"')
    rest = [""] * (split + 1) + list(lines[split + 1:])
    with tempfile.TemporaryDirectory(prefix="mlip-lammps-") as tmp:
        SCRATCH.append(tmp)
        path = os.path.join(tmp, os.path.basename(deck_path) or "deck")
        with open(path, "w") as f:
            f.write("\n".join(rest) + "\n")
        try:
            lmp.file(path)
        finally:
            SCRATCH.remove(tmp)
    return bridge
