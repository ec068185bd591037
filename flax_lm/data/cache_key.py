"""A fingerprint of the code a function runs: its source and that of every function of the script or of flax_lm it
calls, directly or through others, with the constants they read. The token cache is keyed by it, so that a copy of a
script under another name reuses the cache, an edit anywhere on the way from texts to tokens (in the script or in the
package) makes it anew, and an edit of anything else in the file does not."""

import functools
import hashlib
import inspect
import types
import warnings


def is_own_code(value, script_module: str) -> bool:
    """Whether `value` is a function or class of the script (its module `script_module`) or of flax_lm, whose code
    the fingerprint follows; library code (numpy, tokenizers, datasets) is keyed by the versions it comes in."""
    if not isinstance(value, (types.FunctionType, type)):
        return False
    module = getattr(value, "__module__", "") or ""
    return module == script_module or module == "flax_lm" or module.startswith("flax_lm.")


def referenced_names(code: types.CodeType) -> set[str]:
    """The global and attribute names a code object and the functions nested in it read."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= referenced_names(constant)
    return names


CONSTANT_TYPES = (bool, int, float, str, bytes, tuple, frozenset)


def module_attributes(module: types.ModuleType, names: set[str]) -> list[tuple[str, object]]:
    """The attributes of `module` among `names`, in order, without the FutureWarning numpy prints when asked for a
    removed alias (np.str, np.object): code that reads `.str` of anything, beside `np.`, asks numpy for it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return [(name, getattr(module, name)) for name in sorted(names) if hasattr(module, name)]


def function_code_fingerprint(function) -> str:
    """sha256 of the source of `function` and of the own code it reaches (is_own_code) through the names it reads:
    the functions and classes it calls or passes on, those of modules it reads attributes of (`texts.token_arrays`),
    and the plain constants (numbers, strings, tuples) among those names. Of a functools.partial, the code of the
    function it calls: the values it binds are settings, which a cache records apart where they change the rows."""
    while isinstance(function, functools.partial):
        function = function.func
    script_module = function.__module__
    digest = hashlib.sha256()
    seen, pending = set(), [function]
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        # By its name within its module, not the module's: a script runs as __main__, or as its file's name when
        # imported, and a copy under another name is the same code.
        digest.update(f"{value.__qualname__}\n{inspect.getsource(value)}".encode())
        functions = [value] if isinstance(value, types.FunctionType) else list(vars(value).values())
        for member in (candidate for candidate in functions if isinstance(candidate, types.FunctionType)):
            names = referenced_names(member.__code__)
            for name in sorted(names & member.__globals__.keys()):
                found = member.__globals__[name]
                if isinstance(found, types.ModuleType):  # `module.name`: the names of the module the code reads
                    reached = [(f"{name}.{attribute}", value) for attribute, value in module_attributes(found, names)]
                else:
                    reached = [(name, found)]
                for reached_name, candidate in reached:
                    if is_own_code(candidate, script_module):
                        pending.append(candidate)
                    elif isinstance(candidate, CONSTANT_TYPES) and not reached_name.startswith("__"):
                        digest.update(f"{reached_name}={candidate!r}\n".encode())
    return digest.hexdigest()[:24]
