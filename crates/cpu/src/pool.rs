//! A small fork-join thread pool for the CPU backend's ops.
//!
//! ## Why not rayon
//! A decode step of a small model is ~150–300 short parallel regions (one per matmul, a few
//! tens of microseconds each). With rayon every region is `install` + `par_iter`: the caller
//! hands the job to a worker and blocks, and idle workers go to sleep on a futex, so each region
//! pays one or two futex wake-ups (tens of µs on a loaded machine, as much as the work itself).
//! This pool instead:
//! * runs tasks on the **calling thread too** (with `n` threads there are `n − 1` workers);
//! * lets workers **spin briefly, then spin with `sched_yield`, then park** (a few hundred µs in
//!   all, about the gap between two ops of one forward), so back-to-back regions start without a
//!   system call, yet a waiting thread hands its core to whoever else is runnable — on this
//!   shared machine plain spinning made two threads slower than one;
//! * hands out tasks **dynamically** from one atomic word, so when another process takes a core
//!   for a while the other thread simply takes more tasks (a static split would wait for the
//!   slowest thread);
//! * falls back to **serial regions** for a while after a worker was preempted in the middle of
//!   a task (see [`Adapt`]).
//!
//! If the pool is already busy (a nested call from inside a task, or another thread using the
//! same backend concurrently) the region runs serially on the caller: same result, no deadlock.

use std::any::Any;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// The claim word packs (generation, next task, task count) so that one compare-and-swap both
/// claims a task and proves the region it belongs to is still running.
const IDX_BITS: u32 = 20;
const MAX_TASKS: usize = (1 << IDX_BITS) - 1;
const GEN_MASK: u64 = (1 << (64 - 2 * IDX_BITS)) - 1;

fn pack(generation: u64, idx: usize, n: usize) -> u64 {
    ((generation & GEN_MASK) << (2 * IDX_BITS)) | ((idx as u64) << IDX_BITS) | n as u64
}
fn unpack(w: u64) -> (u64, usize, usize) {
    (w >> (2 * IDX_BITS), ((w >> IDX_BITS) as usize) & MAX_TASKS, (w as usize) & MAX_TASKS)
}

type TaskFn = dyn Fn(usize) + Sync;

struct Shared {
    /// Bumped once per region (masked to `GEN_MASK`); workers look for work when it changes.
    generation: AtomicU64,
    /// `pack(generation, next task, n_tasks)` of the current region.
    claim: AtomicU64,
    /// The current region's task function: points at the caller's `&TaskFn` on its stack in
    /// [`Pool::run`] (lifetime erased; see there).
    f: AtomicPtr<&'static TaskFn>,
    /// Tasks of the current region that have finished.
    done: AtomicUsize,
    /// Per worker: parked (or about to park) and needs an unpark to see the next region.
    sleeping: Vec<AtomicBool>,
    /// The caller of the current region, parked while waiting for the last tasks (see
    /// [`Pool::run`]); `waiter` is who to unpark.
    caller_parked: AtomicBool,
    waiter: Mutex<Option<Thread>>,
    /// The first panic of a task in the current region, re-raised on the caller.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    quit: AtomicBool,
}

impl Shared {
    /// Claim and run tasks of region `generation` until none are left. `f` is only called on a
    /// successful claim, and a claim only succeeds while the region is unfinished — which is
    /// what keeps the (possibly stale) function read by a late worker from ever being called.
    ///
    /// Safety: `f` must be valid while region `generation` is unfinished.
    unsafe fn run_tasks(&self, generation: u64, f: *const &TaskFn) {
        let mut w = self.claim.load(SeqCst);
        loop {
            let (g, i, n) = unpack(w);
            if g != generation & GEN_MASK || i >= n {
                return;
            }
            match self.claim.compare_exchange_weak(w, w + (1 << IDX_BITS), SeqCst, SeqCst) {
                Ok(_) => {
                    if let Err(p) = catch_unwind(AssertUnwindSafe(|| (*f)(i))) {
                        self.panic.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(p);
                    }
                    self.done.fetch_add(1, SeqCst);
                    if self.caller_parked.load(SeqCst) && self.caller_parked.swap(false, SeqCst) {
                        if let Some(t) = self.waiter.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                            t.unpark();
                        }
                    }
                    w = self.claim.load(SeqCst);
                }
                Err(cur) => w = cur,
            }
        }
    }
}

pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
    busy: Mutex<Adapt>,
    threads: usize,
}

impl Pool {
    /// A pool of `threads` (≥ 1) threads counting the caller: `threads − 1` workers are started.
    pub fn new(threads: usize, name: &str) -> std::io::Result<Pool> {
        let threads = threads.max(1);
        let nw = threads - 1;
        let shared = Arc::new(Shared {
            generation: AtomicU64::new(0),
            claim: AtomicU64::new(0),
            f: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            sleeping: (0..nw).map(|_| AtomicBool::new(false)).collect(),
            caller_parked: AtomicBool::new(false),
            waiter: Mutex::new(None),
            panic: Mutex::new(None),
            quit: AtomicBool::new(false),
        });
        let mut workers = Vec::with_capacity(nw);
        for w in 0..nw {
            let sh = shared.clone();
            let h = std::thread::Builder::new().name(format!("{name}-{}", w + 1)).spawn(move || worker(sh, w))?;
            let t = h.thread().clone();
            workers.push((h, t));
        }
        Ok(Pool { shared, workers, busy: Mutex::new(Adapt::default()), threads })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Run `f(i)` for every `i` in `0..n_tasks`, spread over the pool's threads (the caller
    /// included); returns when all have run. Tasks may run in any order on any thread. A panic
    /// in a task is re-raised here once every task has finished.
    pub fn run(&self, n_tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if n_tasks <= 1 || self.workers.is_empty() || n_tasks > MAX_TASKS {
            (0..n_tasks).for_each(f);
            return;
        }
        let Ok(mut adapt) = self.busy.try_lock() else {
            // Nested or concurrent use: run serially rather than wait or deadlock.
            (0..n_tasks).for_each(f);
            return;
        };
        adapt.region += 1;
        if adapt.region < adapt.serial_until {
            (0..n_tasks).for_each(f);
            return;
        }
        let sh = &*self.shared;
        let generation = sh.generation.load(SeqCst).wrapping_add(1);
        // Lifetime erased: a worker calls the function only after a successful claim of this
        // region, and this call returns only after all n_tasks claimed tasks are done, so `fref`
        // outlives every use.
        let fref: &(dyn Fn(usize) + Sync) = f;
        let fptr = &fref as *const &(dyn Fn(usize) + Sync) as *mut &'static TaskFn;
        sh.f.store(fptr, SeqCst);
        sh.done.store(0, SeqCst);
        sh.claim.store(pack(generation, 0, n_tasks), SeqCst);
        sh.generation.store(generation, SeqCst);
        for (w, (_, t)) in self.workers.iter().enumerate() {
            if sh.sleeping[w].swap(false, SeqCst) {
                t.unpark();
            }
        }
        let t_start = Instant::now();
        // SAFETY: fptr is valid until we return.
        unsafe { sh.run_tasks(generation, fptr) };
        let t_own = t_start.elapsed();
        // Wait for tasks other threads claimed: spin a little, then sleep until the last one
        // is done. Sleeping (rather than yielding) matters on a shared machine: when the worker
        // holding the task has been preempted, an idle core is what lets the scheduler move it
        // here at once instead of after the other core's time slice.
        let mut backoff = Backoff::new(CALLER_SPIN, CALLER_YIELD);
        while sh.done.load(SeqCst) != n_tasks {
            if backoff.wait() {
                continue;
            }
            {
                let mut w = sh.waiter.lock().unwrap_or_else(|e| e.into_inner());
                let me = std::thread::current();
                if w.as_ref().map(|t| t.id()) != Some(me.id()) {
                    *w = Some(me);
                }
            }
            sh.caller_parked.store(true, SeqCst);
            if sh.done.load(SeqCst) != n_tasks {
                std::thread::park();
            }
            sh.caller_parked.store(false, SeqCst);
        }
        adapt.after_region(t_own, t_start.elapsed() - t_own);
        if let Some(p) = sh.panic.lock().unwrap_or_else(|e| e.into_inner()).take() {
            resume_unwind(p);
        }
    }
}

/// Fallback to serial regions when the machine is oversubscribed.
///
/// A region cannot end before every claimed task has finished, so when another process
/// preempts a worker in the middle of a task, the caller waits for the rest of that worker's
/// time slice (milliseconds, against regions of tens of µs). When that happens the caller runs
/// the next regions alone (as with one thread), for a period that doubles while stalls keep
/// coming back and resets after a long clean run; the workers park meanwhile.
#[derive(Default)]
struct Adapt {
    region: u64,
    serial_until: u64,
    /// Serial period after the next stall (regions); 0 = the initial one.
    backoff: u64,
    clean_since: u64,
}

impl Adapt {
    const FIRST: u64 = 256;
    const MAX: u64 = 16384;
    /// A wait this long (and longer than the caller's own share) means a preempted worker.
    const STALL: Duration = Duration::from_micros(500);

    fn after_region(&mut self, own: Duration, waited: Duration) {
        if waited > Self::STALL && waited > own {
            self.backoff = if self.backoff == 0 { Self::FIRST } else { (self.backoff * 2).min(Self::MAX) };
            self.serial_until = self.region + self.backoff;
            self.clean_since = self.serial_until;
        } else if self.region - self.clean_since > 4 * Self::MAX {
            self.backoff = 0;
        }
    }
}

/// Worker between regions: spin, then spin with yields, then park.
const WORKER_SPIN: Duration = Duration::from_micros(10);
const WORKER_YIELD: Duration = Duration::from_micros(300);
/// Caller waiting for other threads' last tasks: spin, then yield, then park.
const CALLER_SPIN: Duration = Duration::from_micros(10);
const CALLER_YIELD: Duration = Duration::from_micros(100);

/// Waiting in three phases: spin (cheapest wake-up) until `spin`, then spin with
/// `sched_yield` until `yield_until` (on a loaded machine this hands the core to whoever else
/// is runnable instead of burning our time slice), then the caller parks.
struct Backoff {
    t0: Option<Instant>,
    spins: u32,
    spin: Duration,
    yield_until: Duration,
}

impl Backoff {
    fn new(spin: Duration, yield_until: Duration) -> Self {
        Backoff { t0: None, spins: 0, spin, yield_until }
    }
    /// One wait step; false when it is time to park.
    #[inline]
    fn wait(&mut self) -> bool {
        self.spins = self.spins.wrapping_add(1);
        if !self.spins.is_multiple_of(32) {
            std::hint::spin_loop();
            return true;
        }
        let el = self.t0.get_or_insert_with(Instant::now).elapsed();
        if el < self.spin {
            std::hint::spin_loop();
            true
        } else if el < self.yield_until {
            std::thread::yield_now();
            true
        } else {
            false
        }
    }
}

fn worker(sh: Arc<Shared>, w: usize) {
    let mut seen = 0u64;
    loop {
        // Wait for a new generation: spin, then park.
        let mut backoff = Backoff::new(WORKER_SPIN, WORKER_YIELD);
        let generation = loop {
            let g = sh.generation.load(SeqCst);
            if g != seen {
                break g;
            }
            if sh.quit.load(SeqCst) {
                return;
            }
            if backoff.wait() {
                continue;
            }
            // Announce the park, then re-check so a region published meanwhile is not missed
            // (an unpark that comes before park() makes park() return at once).
            sh.sleeping[w].store(true, SeqCst);
            if sh.generation.load(SeqCst) == seen && !sh.quit.load(SeqCst) {
                std::thread::park();
            }
            sh.sleeping[w].store(false, SeqCst);
            backoff = Backoff::new(WORKER_SPIN, WORKER_YIELD);
        };
        seen = generation;
        // The function pointer was stored before the generation; if the caller has meanwhile
        // moved on to a later region it may be newer (or dangling), but then no claim of
        // `generation` can succeed and it is never dereferenced.
        let f = sh.f.load(SeqCst);
        // SAFETY: see above and `Pool::run`.
        unsafe { sh.run_tasks(generation, f) };
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.quit.store(true, SeqCst);
        for (_, t) in &self.workers {
            t.unpark();
        }
        for (h, _) in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn pool_runs_every_task_once() {
        for threads in [1, 2, 3] {
            let p = Pool::new(threads, "t").unwrap();
            for n in [0usize, 1, 2, 5, 100] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                for _ in 0..50 {
                    p.run(n, &|i| {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    });
                }
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 50));
            }
        }
    }

    #[test]
    fn pool_survives_parking_and_nesting() {
        let p = Pool::new(2, "t").unwrap();
        let sum = AtomicUsize::new(0);
        for round in 0..3 {
            if round > 0 {
                std::thread::sleep(Duration::from_millis(5)); // workers park
            }
            p.run(8, &|i| {
                // A nested region runs serially on this thread.
                p.run(3, &|j| {
                    sum.fetch_add(i * 3 + j, Ordering::Relaxed);
                });
            });
        }
        assert_eq!(sum.load(Ordering::Relaxed), 3 * (0..24).sum::<usize>());
    }
}
#[cfg(test)]
mod bench {
    use super::*;
    use std::sync::atomic::Ordering;
    #[test]
    #[ignore = "benchmark: `cargo test --release -p ts-cpu pool_bench -- --ignored --nocapture`"]
    fn pool_bench() {
        let p = Pool::new(2, "b").unwrap();
        for work_us in [0u64, 2, 10] {
            let on_main = AtomicUsize::new(0);
            let total = AtomicUsize::new(0);
            let main_id = std::thread::current().id();
            let t = Instant::now();
            let regions = 20000;
            for _ in 0..regions {
                p.run(8, &|_| {
                    let t0 = Instant::now();
                    while t0.elapsed().as_nanos() < (work_us * 1000) as u128 {
                        std::hint::spin_loop();
                    }
                    total.fetch_add(1, Ordering::Relaxed);
                    if std::thread::current().id() == main_id {
                        on_main.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
            let el = t.elapsed().as_secs_f64();
            eprintln!(
                "work {work_us} us x 8: {:.2} us/region (ideal {:.2}), main did {:.1}%",
                el / regions as f64 * 1e6,
                4.0 * work_us as f64,
                100.0 * on_main.load(Ordering::Relaxed) as f64 / total.load(Ordering::Relaxed) as f64
            );
        }
    }
}
