"""The rehearsal room: rank 0 of a world-N job run on this machine under torch's fake process group
(``dsclip plan ... --measure``), with the engine, the model and the step ``dsclip train`` builds.

* room: the rehearsal itself: the parent's checks, the child process with its fake world, the timed steps
* counter: the collective counter (bytes and calls per kind and phase) and the fake group's filled outputs
* report: what ``--measure`` prints beside the plan

Above dsclip.plan (which never imports it) and beside dsclip.train (whose builders it runs). Nothing is
imported here: ``python -m dsclip.rehearsal.room`` is the child process.
"""
