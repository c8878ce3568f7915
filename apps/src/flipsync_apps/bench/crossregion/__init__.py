"""``flipsync bench crossregion``: from ``optimizer.step()`` returning to the last replica verified, over WAN links.

**Trainer.** FP32 masters (four Llama-sized ``(rows, 1024)`` matrices, N(0, 0.02^2)) trained by
``torch.optim.Adam`` (lr 1e-6, betas 0.9/0.999) on Gaussian-noise gradients; a few warm-up steps, then one
measured step. The state after the warm-up and the measured step's gradient are kept, and every run restores
them: every method and every repeat publishes the same v0 -> v1 (checked bit for bit at every replica).
The served view is bf16; what changes in it comes from real Adam absorption at that learning rate.

**Clock.** It starts when ``optimizer.step()`` returns, and stops when the last replica holds v1 with its
fingerprint verified. For patches the step runs with the real trainer publisher attached
(``flipsync.trainer.Publisher``, background mode: the post-step hook hands the masters to the view thread,
then diff, encode and upload run on the worker, with its default coders), warmed by two
versions of unchanged weights first so that
the measured step is a steady-state one (pooled buffers); for full checkpoints the trainer casts the masters to bf16,
fingerprints them and writes them as a snapshot (``BoardWriter.publish_snapshot``). Both therefore include
the trainer's own work, the board write (a local directory), the replicas' polling, download, decode,
apply and verification.

**Replicas.** N real reconcile loops (``Replica`` + ``BoardReader``) over a light in-memory engine
(``flipsync.engines.memory.MemoryEngine``: a dict of tensors kept current by ``codec.stage``/``codec.commit``,
fingerprint checked), so 16
fit in memory; all in this process, sharing this machine's cores. Their engines start holding v0, which they
find on the board.

**Links.** Each replica reads the board through its own link, ``ThrottledStore(open_store(dir), B)``: a token
bucket in the store client (``flipsync.board.throttle``) charges every byte read, refills at B bytes/s and
holds at most 50 ms of traffic. It models bandwidth only (no latency, no loss); writes are not limited.

**Methods.** *patch*: every replica fetches the patch over its own link. *patch + relay*: one relay per island
(``flipsync relay``: a read-through cache over HTTP); only the relay's upstream is limited, so the WAN
carries each object once (WAN bytes = the relay's upstream bytes). *full*: the trainer publishes the whole
served view and every replica downloads and loads it over its own link.

**Cost model.** Per-unit costs fitted from separate measurements: trainer seconds per byte of served view
(from the N=1 runs' step-to-published time), wire seconds per byte (1/B), receiver seconds per changed value
(stage + commit on one engine) or per byte (keyframe read + load + fingerprint), and a fixed per-update
latency (polling, manifests: the unlimited-link run minus its trainer and receiver parts). Receivers share
the machine's cores: their CPU terms scale by max(1, N / cores). The model then extrapolates to a 500 GB
bf16 served view.

**Modules.** ``trained`` (the workload: the measured Adam step), ``race`` (the harness: trainers, replicas,
links, relays, one timed run), ``costs`` (the cost model and its extrapolation), ``measure`` (the schedule of
runs and the fit: ``run``) and ``render`` (tables, markdown, plot).
"""

from flipsync_apps.bench.crossregion.measure import FULL, QUICK, Setup, run
from flipsync_apps.bench.crossregion.render import full_over_patch, markdown, plot, tables

__all__ = ["FULL", "QUICK", "Setup", "full_over_patch", "markdown", "plot", "run", "tables"]
