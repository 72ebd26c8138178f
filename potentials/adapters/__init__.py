"""Other packages' trained models, run through their own code with our halo between their layers.

* ``sevennet.SevenNet``: a SevenNet checkpoint (sevenn's modules, halo after each
  ``{t}_self_interaction_1``).
* ``mace.MACE``: a MACE ``.model`` file (mace-torch's modules, halo through MACE's own
  ``lammps_mliap`` ghost-exchange hook); read by ``potentials.pickled`` without running the pickle's code.
* ``nequip.NequIPFramework``: a NequIP or Allegro model of the nequip framework (``.ckpt`` or
  ``.nequip.zip``; the framework's modules, halo through its own ghost-exchange slots).
* ``fairchem.FAIRChem``: a fairchem UMA or eSEN checkpoint (fairchem-core's modules, halo on the node
  embeddings entering each block's edge step); read without running the pickle's code.

Only the adapters are here; what they share with the checkpoints sits beside them in ``potentials``: ``pickled``
(the restricted unpickler), ``exchange.GhostExchange`` (the LAMMPS-ML-IAP-style exchange object MACE and nequip call),
``plain`` (their configs as JSON) and ``process`` (what a package changes in the process, put back).

Each belongs to a model family (``potentials.families``: one record per family, ``load_model`` dispatching
through them).
"""
