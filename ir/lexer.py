"""The lexer of the plan parser: lark's contextual lexer with a faster loop (a plan has 100k
lines; most of its parse is making tokens)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from lark import Token
from lark.common import LexerConf
from lark.lexer import ContextualLexer, Lexer, LexerState


class FastContextualLexer(Lexer):
    """lark's contextual lexer (one BasicLexer per parser state, built by lark from the same
    grammar), driven by a tighter loop: one regular expression per state that also takes the
    blanks before a token, and positions counted here rather than by a LineCounter per token.
    The tokens are the ones lark's own loop makes. Where this loop finds no token it hands the
    rest of the text to lark's loop, so that errors are lark's own, raised at the same place."""

    __future_interface__ = 2  # lex(lexer_state, parser_state), as lark's own lexers

    def __init__(self, conf: LexerConf):
        self.conf = conf
        self.contextual: ContextualLexer | None = None
        self.by_state: dict[int, tuple] = {}

    def _build(self, parse_table) -> ContextualLexer:
        # as lark builds its contextual lexer for an LALR parser
        states = {index: list(actions) for index, actions in parse_table.states.items()}
        return ContextualLexer(self.conf, states)

    def _for_state(self, state: int) -> tuple:
        lexer = self.contextual.lexers[state]
        scanner = lexer.scanner  # (also makes lexer.callback)
        blanks = [t for t in scanner.terminals
                  if t.name in lexer.ignore_types and t.name not in lexer.callback]
        prefix = "".join(f"(?:{t.pattern.to_regexp()})?" for t in blanks)
        # the alternation lark's scanner matches, after optional blanks
        alternation = "|".join(f"(?P<{t.name}>{t.pattern.to_regexp()})" for t in scanner.terminals)
        entry = (re.compile(prefix + "(?:" + alternation + ")", lexer.g_regex_flags).match,
                 lexer.callback, lexer.newline_types, lexer.ignore_types)
        self.by_state[state] = entry
        return entry

    def lex(self, lexer_state: LexerState, parser_state) -> Iterator[Token]:
        if self.contextual is None:
            self.contextual = self._build(parser_state.parse_conf.parse_table)
        by_state = self.by_state
        states = parser_state.state_stack  # the last is the parser's state (its `position`)
        text = lexer_state.text.text
        end = lexer_state.text.end
        counter = lexer_state.line_ctr
        pos, line, line_start = counter.char_pos, counter.line, counter.line_start_pos
        last = lexer_state.last_token
        new_str = str.__new__
        while pos < end:
            state = states[-1]
            entry = by_state.get(state) or self._for_state(state)
            m = entry[0](text, pos, end)
            if m is None:
                break  # lark's loop raises the error
            type_ = m.lastgroup
            start = m.start(type_)
            pos = m.end()
            value = text[start:pos]
            # a Token with every field set, as lark's lexer makes it (without its constructor's
            # two Python calls: most of a plan's parse is making tokens)
            tok = new_str(Token, value)
            tok.type = type_
            tok.value = value
            tok.start_pos = start
            tok.line = line
            tok.column = start - line_start + 1
            tok.end_pos = pos
            if type_ in entry[2] and "\n" in value:  # a token that may hold line ends does
                line += value.count("\n")
                line_start = start + value.rindex("\n") + 1
            tok.end_line = line
            tok.end_column = pos - line_start + 1
            if type_ in entry[1]:
                tok = entry[1][type_](tok)
            if type_ not in entry[3]:
                last = tok
                yield tok
        counter.char_pos, counter.line, counter.line_start_pos = pos, line, line_start
        counter.column = pos - line_start + 1
        lexer_state.last_token = last
        if pos < end:
            yield from self.contextual.lex(lexer_state, parser_state)
