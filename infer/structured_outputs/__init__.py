"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a grammar.

    constraint.py    StructuredOutputs, the request's constraint as pure data (no torch: SamplingParams
                     carries it)
    grammar_text.py  llguidance's grammar for a constraint, refused up front past the bounds that keep
                     compiling and every step cheap (forced_text.py: the text a grammar forces)
    compiler.py      GrammarCompiler: compiles off the engine thread, one compilation per distinct
                     grammar, a copy of the matcher per request (compile_pool.py: the bounds and the
                     cache in bytes; text_process.py: the grammar text built in worker processes)
    matcher.py       Grammar, one request's matcher step by step, and `banned`, the step's bitmask
    tool_calls.py    the JSON schema a forced tool_choice constrains the output to

Nothing here is imported by this file, so that constraint.py stays importable without torch.
"""
