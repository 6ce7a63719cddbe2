#!/usr/bin/env python3
"""Checks that the crate's modules import downward and that no modules import each other in a loop.

What it reads: the module tree from `src/lib.rs` down (`mod x;`, and inline `mod x { … }`), each
file whole, with comments and the insides of string and char literals (raw ones too) blanked, and
each `#[cfg(test)]` item taken out by matching its brackets: a `mod tests { … }`, a `fn`, `impl`
or `if` block, a `mod tests;` line (so `tests.rs` files and `tests/` folders are never read for
arrows), a `use`. Tests may use any module.

What it follows: every `use` (nested groups `a::{b, c::{d, e}}`, `self`, `as`, globs) and every
path in code that starts with `crate::`, `$crate::`, `super::` or `self::`, resolved from the
module it is written in through the `use` lines of the modules it passes, the root's `pub use`
re-exports too (`crate::NumaTopology` is an arrow to topology, not to the root), to the module
that defines the name. A path also points at each module whose `use` it goes through (other than
the root and the modules holding the file). A name found nowhere is the script's own error
(exit 2), never dropped. Methods are not followed: a type whose `impl` blocks are spread over
files does not make arrows between them.

What it checks:
- between the crate's top modules, that each arrow points down the layer map (the table of
  ARCHITECTURE.md, "The layers", read from there: it is kept in that one place) or stays in its
  layer; a
  root module that only re-exports lower ones (`FRONT_END_REEXPORTS`: `unstable`) is a front end,
  in the top layer;
- at every level, that no submodules of one module use each other in a loop: the top modules,
  then within each module its submodules (a file, or a folder taken whole). A module's own file
  (`mod.rs`, `x.rs`) is the hub: its submodules may use what it defines, and it theirs;
- that every file under src/ is in the module tree (with its tests);
- that every `something.rs` (or `.c`, `.py`, `.sh`, `.md`, `.toml`) a comment under src/ names
  exists, relative to src/, to the file's folder, to its module's folder, or to the repository.

`KNOWN_LOOPS` lists the loops that take a redesign to break, each with why: printed as known; the
check fails if one is gone (take it off the list) or a loop not listed appears. `--self-test`
copies src/ to a temporary folder, plants each of `SELF_TEST`'s lines in a copy of its own, and
requires the check on it to give the exit status and name the arrow the entry says, and the
unplanted copy to pass. Exit status: 0 clean, 1 a problem found, 2 the script's own error.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

# Root modules that only re-export lower ones (for benchmarks and tools): front ends, top layer.
FRONT_END_REEXPORTS = ["unstable"]

# Loops that take a redesign to break: {frozenset of files relative to src/ (or top modules):
# why}. None today.
KNOWN_LOOPS = {}

# Planted by --self-test, each in a copy of src/ of its own: (file under src/, the line after
# which, None for after the file's first `use` line; the lines planted; the exit status the check
# must give; the line of its output that must say so, followed by the planted last line's
# `file:line:` alone (no other place: a test module's import must not count)).
LITERALS = r"""#[cfg(test)]
mod planted_tests {
    use crate::runtime::Runtime; // tests may use any module
    fn f<'a>(s: &'a str) -> (&'a str, &'static str, char, u8) { (s, "{", '{', b'{') } /* { */
    const RAW: &str = r#"{"#; // {
}
use crate::{chunk::Chunk, runtime::{route, Runtime as Planted}};"""


def upward(low, high, layers):
    """The line the check prints for an arrow from `low` up to `high` (numbered from `layers`)."""
    number = {m: i + 1 for i, layer in enumerate(layers) for m in layer}
    return f"upward: {low} (layer {number[low]}) -> {high} (layer {number[high]})"


# The line to find: a string, or (low, high) for `upward`'s line in the table's numbering.
SELF_TEST = [
    ("arena/mod.rs", 39, "use crate::runtime::Runtime;", 1, ("arena", "runtime")),
    ("cuda/event.rs", None, "use crate::NumaGpuAlloc;", 1, ("cuda", "alloc")),
    ("chunk/mod.rs", None, "use super::runtime::Resolved;", 1, ("chunk", "runtime")),
    # A test module with brackets in literals and comments, then a nested group.
    ("arena/mod.rs", 39, LITERALS, 1, ("arena", "runtime")),
    # Through the hub's re-export (`sys/mod.rs`: `pub use mem::map_anonymous`); mem.rs uses
    # fault.rs, so this is a loop within sys/.
    ("sys/fault.rs", None, "use super::map_anonymous;", 1, "    sys/fault.rs -> sys/mem.rs"),
    # A root name nobody re-exports.
    ("chunk/mod.rs", None, "use crate::NoSuchName;", 2, "cannot resolve: "),
]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, ".."))


class ScriptError(Exception):
    pass


class Unresolved(Exception):
    def __init__(self, module, name):
        super().__init__(name)
        self.module, self.name = module, name


# ---------------------------------------------------------------------------------------------
# Reading a file: comments and literals blanked, every newline kept (so offsets give lines).


def ident_char(c):
    return c.isalnum() or c == "_"


def lex(text):
    """(code, comments): `text` with comments and the insides of literals blanked, and each
    comment as (line, text)."""
    out = list(text)
    comments = []
    n = len(text)
    i = 0

    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            comments.append((text.count("\n", 0, i) + 1, text[i:j]))
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            comments.append((text.count("\n", 0, i) + 1, text[i:j]))
            blank(i, j)
            i = j
        elif c in "rbc" and (i == 0 or not ident_char(text[i - 1])) and re.match(
                r'(?:br|cr|r)#*"', text[i:i + 260]):
            m = re.match(r'(?:br|cr|r)(#*)"', text[i:])
            close = '"' + m.group(1)
            start = i + m.end()
            j = text.find(close, start)
            if j < 0:
                line = text.count("\n", 0, i) + 1
                raise ScriptError(f"an unterminated raw string at line {line}")
            blank(start, j)
            i = j + len(close)
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j)
            i = j + 1
        elif c == "'":
            if text.startswith("\\", i + 1):  # '\n', '\'', '\u{1F600}'
                j = text.find("'", i + 3)
                blank(i + 1, j)
                i = j + 1
            elif i + 2 < n and text[i + 2] == "'":  # 'x'
                blank(i + 1, i + 2)
                i += 3
            else:  # a lifetime or a label
                i += 1
        else:
            i += 1
    return "".join(out), comments


OPEN, CLOSE = "([{", ")]}"


def matching(code, i):
    """The index just past the bracket that closes the one at `i`."""
    depth = 0
    for j in range(i, len(code)):
        if code[j] in OPEN:
            depth += 1
        elif code[j] in CLOSE:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ScriptError("unbalanced brackets")


def depths(code):
    """The bracket depth at each offset."""
    out = []
    d = 0
    for ch in code:
        out.append(d)
        if ch in OPEN:
            d += 1
        elif ch in CLOSE:
            d -= 1
    return out


TEST_ATTR = re.compile(r"#\s*\[\s*cfg\s*\(\s*(?:test|all\s*\(\s*test\s*,[^\]]*\))\s*\)\s*\]")
VISIBILITY = r"(?:pub\s*(?:\([^)]*\))?\s*)?"


def item_end(code, i):
    """Where the item, statement or field that starts at `i` (after an attribute) ends: at its `;`,
    at the `}` that closes its first block (an `else` goes on), or at a field's `,`."""
    n = len(code)
    while True:  # further attributes
        while i < n and code[i].isspace():
            i += 1
        if code.startswith("#", i) and code[i + 1:].lstrip().startswith("["):
            i = matching(code, code.index("[", i))
        else:
            break
    head = code[i:i + 400]
    field = re.match(VISIBILITY + r"[A-Za-z_]\w*\s*:(?!:)", head)
    to_semicolon = re.match(
        VISIBILITY + r"(?:use|static|type|let|extern\s+crate|const\s+(?!fn\b))\b", head)
    depth = 0
    for j in range(i, n):
        ch = code[j]
        if ch in OPEN or (field and ch == "<"):
            depth += 1
        elif ch in CLOSE or (field and ch == ">" and code[j - 1] != "-"):
            if depth == 0:
                return j  # the end of the enclosing list
            depth -= 1
            if depth == 0 and ch == "}" and not to_semicolon:
                if not code[j + 1:].lstrip().startswith("else"):
                    return j + 1
        elif depth == 0 and (ch == ";" or (field and ch == ",")):
            return j + 1
    raise ScriptError("a #[cfg(test)] item runs to the end of its file")


def strip_tests(code):
    """`code` with every `#[cfg(test)]` item blanked (newlines kept)."""
    if re.search(r"#!\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", code):
        return re.sub(r"[^\n]", " ", code)
    out = list(code)
    pos = 0
    while True:
        m = TEST_ATTR.search(code, pos)
        if not m:
            return "".join(out)
        end = item_end(code, m.end())
        for k in range(m.start(), end):
            if out[k] != "\n":
                out[k] = " "
        pos = end


def parse_use_tree(text):
    """`a::{b, c::{self, d as e}, f::*}` -> [(segments, the name it binds, None for a glob)]."""
    tokens = re.findall(r"::|[{},*]|\$?[A-Za-z_]\w*", text)
    pos = [0]

    def peek():
        return tokens[pos[0]] if pos[0] < len(tokens) else None

    def take():
        pos[0] += 1
        if pos[0] > len(tokens):
            raise ScriptError(f"cannot read `use {' '.join(text.split())}`")
        return tokens[pos[0] - 1]

    def tree(prefix):
        segs = list(prefix)
        if peek() == "::":
            take()
        while True:
            t = peek()
            if t == "{":
                take()
                out = []
                while peek() != "}":
                    out += tree(segs)
                    if peek() == ",":
                        take()
                take()
                return out
            if t == "*":
                take()
                return [(segs, None)]
            name = take()
            if name == "self" and peek() != "::" and segs:
                bound = segs[-1]  # `a::{self}` binds `a`
            else:
                segs.append(name)
                bound = name
            if peek() == "::":
                take()
                continue
            if peek() == "as":
                take()
                bound = take()
            return [(segs, bound)]

    return tree([])


# ---------------------------------------------------------------------------------------------
# The module tree.

DEFINITION = re.compile(
    r"(?<![\w$])(?:fn|struct|enum|union|trait|type|macro_rules!"
    r"|(?:const|static(?:\s+mut)?)(?!\s+(?:fn|unsafe|async|extern)\b))\s+(?:r#)?([A-Za-z_]\w*)")
MACRO = re.compile(r"(?<![\w$])macro_rules!\s*([A-Za-z_]\w*)\s*\{")
USE = re.compile(r"(?<![\w$:])use\s+")
PATH = re.compile(r"(?<![\w:$])(\$?crate|super|self)((?:\s*::\s*[A-Za-z_]\w*)+)")


def child_dir_of(file):
    folder, base = os.path.split(file)
    return folder if base in ("lib.rs", "mod.rs") else os.path.join(folder, base[:-3])


class Module:
    def __init__(self, path, file, parent, span, inline):
        self.path = path  # ("runtime", "block"); () for the root
        self.file = file  # relative to src/
        self.parent = parent
        self.span = span  # its text in its file's code: (start, end)
        self.inline = inline
        self.children = {}
        self.inner = []  # the spans of its inline submodules
        self.imports = {}  # name -> [segments], its module-level `use`s
        self.globs = []  # [segments]
        self.defined = set()
        self.calls = set()  # the macros it calls
        self.uses = []  # (start, end, [(segments, bound)]): every `use` in it, in functions too

    def name(self):
        if not self.path:
            return "the root"
        return self.file + ("::" + self.path[-1] if self.inline else "")

    def owns(self, offset):
        return not any(a <= offset < b for a, b in self.inner)


class Crate:
    def __init__(self, src):
        self.src = src
        self.codes = {}  # file -> code, blanked, tests taken out
        self.raw_codes = {}  # file -> code, blanked, tests kept
        self.comments = {}  # file -> [(line, text)]
        self.modules = []
        self.macro_items = {}  # macro -> the names its body defines
        self.unresolved = []
        self.root = self.load_file((), "lib.rs", None)
        for module in self.modules:
            for name in module.calls:
                module.defined |= self.macro_items.get(name, set())

    def read(self, file):
        if file not in self.codes:
            with open(os.path.join(self.src, file)) as f:
                code, comments = lex(f.read())
            self.raw_codes[file] = code
            self.codes[file] = strip_tests(code)
            self.comments[file] = comments
        return self.codes[file]

    def child_file(self, child_dir, name):
        for rel in (os.path.join(child_dir, name + ".rs"), os.path.join(child_dir, name, "mod.rs")):
            if os.path.exists(os.path.join(self.src, rel)):
                return os.path.normpath(rel)
        return None

    def load_file(self, path, file, parent):
        code = self.read(file)
        return self.load_region(path, file, child_dir_of(file), parent, (0, len(code)), False)

    def load_region(self, path, file, child_dir, parent, span, inline):
        code = self.codes[file]
        module = Module(path, file, parent, span, inline)
        self.modules.append(module)
        start, end = span
        for m in re.finditer(r"(?<![\w$])mod\s+([A-Za-z_]\w*)\s*([;{])", code[start:end]):
            if not module.owns(start + m.start()):
                continue  # a submodule's submodule
            name = m.group(1)
            if m.group(2) == "{":
                brace = start + m.end() - 1
                body = (brace + 1, matching(code, brace) - 1)
                module.inner.append(body)
                module.children[name] = self.load_region(
                    path + (name,), file, os.path.join(child_dir, name), module, body, True)
            else:
                child = self.child_file(child_dir, name)
                if child is None:
                    raise ScriptError(f"{file}: no file for `mod {name};` in src/{child_dir}")
                module.children[name] = self.load_file(path + (name,), child, module)

        # What a `macro_rules!` body defines is defined where the macro is called.
        macros = []
        for m in MACRO.finditer(code, start, end):
            if module.owns(m.start()):
                body = (m.end() - 1, matching(code, m.end() - 1))
                macros.append(body)
                self.macro_items[m.group(1)] = {
                    d.group(1) for d in DEFINITION.finditer(code, body[0], body[1])}
        for m in DEFINITION.finditer(code, start, end):
            if module.owns(m.start()) and not any(a <= m.start() < b for a, b in macros):
                module.defined.add(m.group(1))
        for m in re.finditer(r"(?<![\w$])([A-Za-z_]\w*)\s*!\s*[({\[]", code[start:end]):
            if module.owns(start + m.start()):
                module.calls.add(m.group(1))

        depth = depths(code[: end + 1])
        level = depth[start]
        for m in USE.finditer(code, start, end):
            if not module.owns(m.start()):
                continue
            semi = code.index(";", m.end())
            leaves = parse_use_tree(code[m.end():semi])
            module.uses.append((m.start(), semi, leaves))
            if depth[m.start()] == level:
                for segs, bound in leaves:
                    if bound is None:
                        module.globs.append(segs)
                    else:
                        module.imports.setdefault(bound, []).append(segs)
        return module

    def resolve(self, origin, segs, seen=frozenset()):
        """Where `segs`, written in `origin`, leads: (module, [modules whose `use` it went
        through], whether it names that module itself); None for another crate's path. Raises
        Unresolved for a name found nowhere."""
        first, rest = segs[0], segs[1:]
        via = []
        if first in ("crate", "$crate"):
            cur = self.root
        elif first == "super":
            cur = origin.parent
        elif first == "self":
            cur = origin
        else:  # a name in scope, or another crate
            found = self.step(origin, first, seen, relative=True)
            if found is None:
                return None
            cur, via, is_module = found
            if not is_module:
                return cur, via, False
        for seg in rest:
            if cur is None:
                raise ScriptError(f"`{'::'.join(segs)}` goes above the root")
            if seg == "super":
                cur = cur.parent
                continue
            if seg == "self":
                continue
            found = self.step(cur, seg, seen, relative=False)
            if found is None:
                return None
            target, more, is_module = found
            via += more
            if not is_module:
                return target, via, False  # what follows is the item's: a variant, a method
            cur = target
        return cur, via, True

    def step(self, cur, name, seen, relative):
        """The name `name` in module `cur`: (module, via, whether it is that module), None when it
        is another crate's."""
        if name in cur.children:
            return cur.children[name], [], True
        if name in cur.imports and (id(cur), name) not in seen:
            found = self.resolve(cur, cur.imports[name][0], seen | {(id(cur), name)})
            if found is None:
                return None
            module, via, is_module = found
            return module, [cur] + via, is_module
        if name in cur.defined:
            return cur, [], False
        for glob in cur.globs:
            try:
                found = self.resolve(cur, glob, seen)
                inner = found and found[2] and self.step(found[0], name, seen, relative=False)
            except Unresolved:
                continue
            if inner:
                return inner[0], [cur] + found[1] + inner[1], inner[2]
        if relative:
            return None  # std, libc, cudarc, …
        raise Unresolved(cur, name)

    def arrows(self):
        """[(from module, to module, file, line, the path as written)]."""
        out = []
        for module in self.modules:
            code = self.codes[module.file]
            start, end = module.span
            for at, _, leaves in module.uses:
                for segs, bound in leaves:
                    text = "use " + "::".join(segs) + ("::*" if bound is None else "")
                    self.add(out, module, segs, code, at, text)
            for m in PATH.finditer(code, start, end):
                at = m.start()
                if not module.owns(at) or any(a <= at < b for a, b, _ in module.uses):
                    continue
                segs = [m.group(1)] + re.findall(r"[A-Za-z_]\w*", m.group(2))
                self.add(out, module, segs, code, at, "::".join(segs))
        return out

    def add(self, out, module, segs, code, at, text):
        line = code.count("\n", 0, at) + 1
        try:
            found = self.resolve(module, segs)
        except Unresolved as e:
            self.unresolved.append(
                f"{module.file}:{line}: `{text}`: no `{e.name}` in {e.module.name()}"
                + (" (the root re-exports no such name)" if not e.module.path else ""))
            return
        if found is None:
            return
        target, via, _ = found
        for dest in via + [target]:
            if dest is not module:
                out.append((module, dest, module.file, line, text))


# ---------------------------------------------------------------------------------------------
# The checks.


def tarjan(graph):
    """The strongly connected components of more than one node, each sorted."""
    index, low, stack, on, loops, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return loops


def layer_table(path):
    """The layer map: the modules column of the table in ARCHITECTURE.md's "The layers", lowest
    layer first; rows must be numbered 1, 2, … in order."""
    text = open(path).read()
    section = text.split("## The layers", 1)
    if len(section) < 2:
        raise ScriptError(f"{path}: no section 'The layers'")
    rows = re.findall(r"^\| (\d+) \| ([^|]*) \|", section[1].split("\n## ", 1)[0], flags=re.M)
    if [int(n) for n, _ in rows] != list(range(1, len(rows) + 1)):
        raise ScriptError(f"{path}: the layer rows are numbered {[n for n, _ in rows]}, not 1, 2, …")
    layers = [[name.strip("/") for name in re.findall(r"`([^`]*)`", mods)] for _, mods in rows]
    if not all(layers):
        raise ScriptError(f"{path}: a layer row names no module: {layers}")
    return layers


def comment_paths(crate):
    """Comments naming a file that is nowhere they could mean."""
    bad = []
    pattern = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[\w-]+\.(?:rs|c|py|sh|md|toml))\b")
    for file, comments in sorted(crate.comments.items()):
        places = [crate.src, os.path.join(crate.src, os.path.dirname(file)),
                  os.path.join(crate.src, child_dir_of(file)), REPO]
        for line, text in comments:
            for m in pattern.finditer(text):
                name = m.group(1)
                if re.search(r"https?://\S*" + re.escape(name), text):
                    continue
                if not any(os.path.exists(os.path.join(p, name)) for p in places):
                    offset = text.count("\n", 0, m.start())
                    bad.append(f"{file}:{line + offset}: a comment names `{name}`, no such file")
    return bad


def files_outside_the_tree(crate):
    """Files under src/ that no `mod` names, tests counted."""
    seen = set()

    def walk(file):
        if file in seen:
            return
        seen.add(file)
        crate.read(file)
        for m in re.finditer(r"(?<![\w$])mod\s+([A-Za-z_]\w*)\s*;", crate.raw_codes[file]):
            child = crate.child_file(child_dir_of(file), m.group(1))
            if child:
                walk(child)

    walk("lib.rs")
    on_disk = set()
    for dirpath, _, files in os.walk(crate.src):
        on_disk |= {os.path.relpath(os.path.join(dirpath, f), crate.src)
                    for f in files if f.endswith(".rs")}
    return [f"{file} is in no module tree (no `mod` names it)" for file in sorted(on_disk - seen)]


def check(src, architecture, verbose=False):
    crate = Crate(src)
    problems = files_outside_the_tree(crate)
    layers = layer_table(architecture)
    layer_of = {m: i for i, layer in enumerate(layers) for m in layer}
    layer_of.update({m: len(layers) - 1 for m in FRONT_END_REEXPORTS})

    arrows = crate.arrows()
    if crate.unresolved:
        for u in crate.unresolved:
            print("cannot resolve:", u)
        raise ScriptError(f"{len(crate.unresolved)} paths resolve nowhere")

    # An arrow belongs to the graph of the deepest module holding both its ends, between the two
    # submodules of it they are in; to none if one end holds the other (the hub and its own).
    graphs = {}
    for source, dest, file, line, text in arrows:
        s, t = source.path, dest.path
        k = 0
        while k < len(s) and k < len(t) and s[k] == t[k]:
            k += 1
        if k < len(s) and k < len(t):
            edges = graphs.setdefault(s[:k], {})
            edges.setdefault((s[: k + 1], t[: k + 1]), set()).add((file, line, text))
    by_path = {m.path: m for m in crate.modules}

    def unit(path):
        return path[0] if len(path) == 1 else by_path[path].name()

    def places(where, most=None):
        shown = sorted(where)[:most]
        more = [f"    (and {len(where) - len(shown)} more)"] if len(where) > len(shown) else []
        return [f"    {f}:{l}: `{t}`" for f, l, t in shown] + more

    if verbose:
        for level, edges in sorted(graphs.items()):
            for (a, b), where in sorted(edges.items()):
                print(f"arrow: {unit(a)} -> {unit(b)}")
                print("\n".join(places(where)))

    top = graphs.get((), {})
    unknown = sorted(m for m in crate.root.children if m not in layer_of)
    if unknown:
        problems.append("modules missing from the layer map: " + ", ".join(unknown))
    for (a, b), where in sorted(top.items()):
        x, y = a[0], b[0]
        if x in layer_of and y in layer_of and layer_of[y] > layer_of[x]:
            arrow = f"upward: {x} (layer {layer_of[x] + 1}) -> {y} (layer {layer_of[y] + 1})"
            problems.append("\n".join([arrow] + places(where)))

    found = {}
    for level, edges in sorted(graphs.items()):
        graph = {}
        for a, b in edges:
            graph.setdefault(a, set()).add(b)
        for loop in tarjan(graph):
            members = frozenset(unit(p) for p in loop)
            lines = []
            for (a, b), where in sorted(edges.items()):
                if a in loop and b in loop:
                    lines.append(f"    {unit(a)} -> {unit(b)}")
                    lines += ["    " + p for p in places(where, 3)]
            scope = "between the top modules" if not level else f"within {'/'.join(level)}/"
            found[members] = f"{scope}: {' <-> '.join(sorted(members))}\n" + "\n".join(lines)
    for members, text in found.items():
        if members in KNOWN_LOOPS:
            head, _, rest = text.partition("\n")
            print(f"known loop {head} ({KNOWN_LOOPS[members]})" + ("\n" + rest if verbose else ""))
        else:
            problems.append("loop " + text)
    for members in KNOWN_LOOPS:
        if members not in found:
            problems.append("a known loop is gone, take it off KNOWN_LOOPS: "
                            + " <-> ".join(sorted(members)))

    problems += comment_paths(crate)
    for p in problems:
        print(p)
    count = sum(len(e) for level, e in graphs.items() if level)
    verdict = "all point down, no loop" + (" but the known" if KNOWN_LOOPS else "")
    print(f"{len(crate.modules)} modules; {len(top)} arrows between the top modules, {count} "
          f"within them; {'problems above' if problems else verdict}")
    return 1 if problems else 0


def self_test(src, architecture):
    failed = 0
    layers = layer_table(architecture)
    with tempfile.TemporaryDirectory() as tmp:
        clean = os.path.join(tmp, "clean")
        shutil.copytree(src, clean)
        code, out = run_copy(clean, architecture)
        print("unplanted copy:", "passes" if code == 0 else f"exit {code}, it must pass")
        if code != 0:
            print(indent(out))
            failed += 1
        for n, (file, after, planted, want_code, want_line) in enumerate(SELF_TEST):
            if isinstance(want_line, tuple):
                want_line = upward(*want_line, layers)
            copy = os.path.join(tmp, f"planted{n}")
            shutil.copytree(src, copy)
            path = os.path.join(copy, file)
            lines = open(path).read().split("\n")
            if after is None:
                after = next(i for i, l in enumerate(lines) if l.startswith("use ")) + 1
            lines[after:after] = planted.split("\n")
            with open(path, "w") as f:
                f.write("\n".join(lines))
            last = f"{file}:{after + planted.count(chr(10)) + 1}:"
            code, out = run_copy(copy, architecture)
            named = named_alone(out, want_line, last)
            label = planted.split("\n")[-1]
            if code == want_code and named:
                verdict = "fails as it must" if code else "passes as it must"
                print(f"`{label}` at {last} {verdict} (exit {code}):")
                print("\n".join("    " + l.strip() for l in named))
            else:
                print(f"`{label}` at {last} exit {code} (must be {want_code}); "
                      f"`{want_line.strip()}` with {last} alone: {'yes' if named else 'no'}")
                print(indent(out))
                failed += 1
    print("self-test:", "passed" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


def named_alone(out, want_line, place):
    """The line of `out` that starts with `want_line` and the places it names (indented under it),
    if they are `place` alone; None otherwise."""
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith(want_line):
            continue
        if want_line.startswith("cannot resolve"):
            return [line] if place in line else None
        block = []
        for more in lines[i + 1:]:
            if not more.startswith(" " * (len(line) - len(line.lstrip()) + 4)):
                break
            block.append(more)
        named = [b for b in block if re.match(r"\s+\S+:\d+: `", b)]
        return [line] + named if named and all(place in b for b in named) else None
    return None


def run_copy(copy, architecture):
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--root", copy, "--architecture", architecture],
        capture_output=True, text=True)
    return p.returncode, p.stdout + p.stderr


def indent(text):
    return "\n".join("    | " + line for line in text.splitlines())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.join(REPO, "src"), help="the src/ to check")
    parser.add_argument("--architecture", default=os.path.join(REPO, "ARCHITECTURE.md"),
                        help="the page whose 'The layers' table is the layer map")
    parser.add_argument("--self-test", action="store_true",
                        help="plant imports in copies of --root that the check must catch")
    parser.add_argument("--verbose", action="store_true", help="print every arrow")
    args = parser.parse_args()
    try:
        if args.self_test:
            return self_test(args.root, args.architecture)
        return check(args.root, args.architecture, args.verbose)
    except ScriptError as e:
        print("layers.py:", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
