"""The sessions: one engine's slots and what autosessd does with them, as a facade (facade.py,
class Sessions: what the inputs and the daemon call, the call protocols and the lock order)
over rooms that each own one invariant. The rooms by floor, each importing only floors below:

    turn, commands   the turn (save held → restore best → prefix; never raises); autosessctl's
                     park/restore/forget, the stop save, the tail's save behind and restore after
    recall, idle, prefix, remote, restores, upkeep, warm
                     a return matched by messages; saving while idle; a shared prefix; the
                     bucket as the turn sees it; the one restore path; the index's life and
                     prune; warming a file into the page cache
    saves            the one save path: what a slot holds, sent to the engine's slot save and
                     handed to the store's finalize
    observe          the engine's truth (GET /slots, cache_n) brought into the slot state machine
    facts, launch, views, watch
                     the engine's facts since its last restart; when the engine may start a
                     request; status, ls, /metrics; engine restarts
    checks, context, held, placement
                     the start checks; what every room reads (config, engine facts, counters);
                     what each slot held last (held.json); tickets, one FIFO per slot
    report, savings, slot
                     counters, events, a turn's result; what autosessd spared its users; one
                     slot's checked state machine
    policy, phases   the turn's pure decisions (where a save is decided); where a turn's time goes

A save is decided in policy.py (the step), made in saves.py (the engine's slot save, through
engines/), and written to disk by store/directory.py (finalize). May import: base, engines,
store, shared; never follow, modes, front or the daemon."""
