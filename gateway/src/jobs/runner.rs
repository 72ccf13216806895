//! The runner: admits jobs (config checked at submit), runs each kind with
//! bounded concurrency on blocking threads, records every state change in
//! the ledger, and lets any number of followers stream a job's events.
//!
//! A job body gets a [`JobCtx`]: `emit` appends to the NDJSON log, updates
//! the row's progress/message and wakes followers; it never fails the job (a
//! log or ledger error is logged and the job goes on). Cancellation is a flag
//! the body checks between steps (`check`, `sleep`). A body that returns an
//! error or panics ends `failed` with the reason; the gateway is unaffected.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::Stream;
use serde_json::Value;
use tokio::sync::{Semaphore, watch};
use tracing::{info, warn};

use super::config::{JobsConfig, PathGuard};
use super::events::{EventLog, LogReader};
use super::kinds::{AdapterMounts, ConfigError, Env, PolicyProvider, Spec};
use super::ledger::{Filter, Ledger, LedgerError, Listing, Page, Patch};
use super::types::{JobEvent, JobKind, JobRow, JobStatus, StoredEvent};
use crate::util::panic_message;

/// How a job body stops short.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    #[error("cancelled")]
    Cancelled,
    #[error("{0}")]
    Failed(String),
}

/// What the jobs service tells its callers (the HTTP layer maps these).
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("no job `{0}`")]
    NotFound(String),
    #[error("job {id} has already finished ({status})")]
    Finished { id: String, status: JobStatus },
    #[error(transparent)]
    Ledger(LedgerError),
    #[error("{0}")]
    Internal(String),
}

impl From<LedgerError> for JobError {
    fn from(e: LedgerError) -> Self {
        match e {
            LedgerError::NotFound(id) => JobError::NotFound(id),
            e => JobError::Ledger(e),
        }
    }
}

/// A running or queued job's shared handles.
struct Live {
    kind: JobKind,
    log: Arc<EventLog>,
    cancel: Arc<AtomicBool>,
    /// Last sequence number written; followers wait on it. Dropped (which
    /// wakes them for good) when the job is over.
    notify: watch::Sender<u64>,
}

/// What a job body reports through.
#[derive(Clone)]
pub struct JobCtx {
    id: String,
    log: Arc<EventLog>,
    ledger: Arc<Ledger>,
    cancel: Arc<AtomicBool>,
    notify: watch::Sender<u64>,
}

impl JobCtx {
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Appends `event` to the log, applies its progress/message to the row
    /// and wakes followers. Never fails: problems are logged.
    pub fn emit(&self, event: JobEvent) {
        let update = event.row_update().map(|(p, m)| (p, m.map(str::to_owned)));
        match self.log.append(event) {
            Ok(stored) => {
                self.notify.send_replace(stored.seq);
            }
            Err(e) => warn!(job = %self.id, error = %e, "cannot write the job's event log"),
        }
        if let Some((progress, message)) = update
            && let Err(e) = self
                .ledger
                .update_progress(&self.id, progress, message.as_deref())
        {
            warn!(job = %self.id, error = %e, "cannot record job progress");
        }
    }

    pub fn log(&self, line: impl Into<String>) {
        self.emit(JobEvent::log(line));
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    /// `Err(Cancelled)` once a cancel was requested; call between steps.
    pub fn check(&self) -> Result<(), RunError> {
        if self.is_cancelled() {
            Err(RunError::Cancelled)
        } else {
            Ok(())
        }
    }

    /// Sleeps `d`, waking early (with `Err(Cancelled)`) on a cancel.
    pub fn sleep(&self, d: Duration) -> Result<(), RunError> {
        let end = Instant::now() + d;
        loop {
            self.check()?;
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(());
            }
            std::thread::sleep(left.min(Duration::from_millis(20)));
        }
    }
}

/// One item of a followed event stream.
#[derive(Debug, Clone)]
pub enum Followed {
    Event(StoredEvent),
    /// Nothing happened for a while (senders may write a keep-alive).
    Idle,
}

/// What the server lends the jobs service beyond its config.
#[derive(Default, Clone)]
pub struct Services {
    /// Opens the policy host (dataset jobs).
    pub policies: Option<PolicyProvider>,
    /// `[adapters] stores` (finetune output); created if missing.
    pub adapter_stores: Vec<PathBuf>,
    /// The served models' adapter mounts (finetune `mount`).
    pub adapters: Option<Arc<dyn AdapterMounts>>,
}

/// The jobs service of one data dir.
pub struct Jobs {
    ledger: Arc<Ledger>,
    config: JobsConfig,
    paths: PathGuard,
    policies: Option<PolicyProvider>,
    adapter_stores: Vec<PathBuf>,
    adapters: Option<Arc<dyn AdapterMounts>>,
    slots: HashMap<JobKind, Arc<Semaphore>>,
    live: Mutex<HashMap<String, Arc<Live>>>,
    /// Set by [`Jobs::shutdown`]: running jobs stop, queued ones stay queued
    /// for the next start, followers' streams end.
    stopping: AtomicBool,
    /// The runtime [`Jobs::start`] ran on, where jobs are driven: a job
    /// submitted over HTTP outlives the connection's serving thread.
    runtime: std::sync::OnceLock<tokio::runtime::Handle>,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, JobError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| JobError::Internal(format!("a blocking jobs task failed: {e}")))
}

impl Jobs {
    /// Opens the ledger in `data_dir`. Call [`Jobs::start`] (inside a tokio
    /// runtime) before serving to recover rows left by a previous process.
    pub fn open(
        data_dir: &Path,
        config: JobsConfig,
        services: Services,
    ) -> Result<Arc<Jobs>, JobError> {
        let ledger = Arc::new(Ledger::open(data_dir)?);
        let roots = if config.allowed_paths.is_empty() {
            vec![data_dir.join("files")]
        } else {
            config.allowed_paths.clone()
        };
        let slots = JobKind::ALL
            .into_iter()
            .map(|k| (k, Arc::new(Semaphore::new(config.concurrency_of(k)))))
            .collect();
        // Canonical, so that checks against them see through symlinks; a
        // store that cannot be created is kept as given (writes fail there).
        let adapter_stores = services
            .adapter_stores
            .iter()
            .map(|s| {
                let _ = std::fs::create_dir_all(s);
                std::fs::canonicalize(s).unwrap_or_else(|_| s.clone())
            })
            .collect();
        Ok(Arc::new(Jobs {
            ledger,
            paths: PathGuard::new(&roots),
            config,
            policies: services.policies,
            adapter_stores,
            adapters: services.adapters,
            slots,
            live: Mutex::new(HashMap::new()),
            stopping: AtomicBool::new(false),
            runtime: std::sync::OnceLock::new(),
        }))
    }

    fn env(&self) -> Env<'_> {
        Env {
            enable_crash: self.config.enable_crash,
            paths: &self.paths,
            policies: self.policies.as_ref(),
            adapter_stores: &self.adapter_stores,
            adapters: self.adapters.as_ref(),
        }
    }

    fn live(&self, id: &str) -> Option<Arc<Live>> {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(id)
            .cloned()
    }

    fn forget(&self, id: &str) {
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(id);
    }

    /// Start-up: rows `running` under a dead process become `zombie` (with a
    /// closing `failed` event in their log); `queued` rows are run again.
    pub fn start(self: &Arc<Self>) -> Result<(), JobError> {
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let _ = self.runtime.set(rt);
        }
        let rec = self.ledger.recover()?;
        for row in &rec.zombies {
            warn!(job = %row.id, kind = %row.kind, "job was running when the gateway died; marked zombie");
            match EventLog::open(Path::new(&row.log_path)) {
                Ok(log) => {
                    let event = JobEvent::Failed {
                        error: row.error.clone().unwrap_or_default(),
                        status: Some(JobStatus::Zombie),
                    };
                    if let Err(e) = log.append(event) {
                        warn!(job = %row.id, error = %e, "cannot close the zombie's event log");
                    }
                }
                Err(e) => warn!(job = %row.id, error = %e, "cannot open the zombie's event log"),
            }
        }
        for row in rec.queued {
            match Spec::parse(row.kind, &row.config, &self.env()) {
                Ok(spec) => {
                    info!(job = %row.id, kind = %row.kind, "re-queueing job from a previous run");
                    self.launch(&row, spec)?;
                }
                Err(e) => {
                    let error = format!("its config is no longer valid ({}): {e}", e.param);
                    let log = EventLog::open(Path::new(&row.log_path));
                    self.ledger.transition(
                        &row.id,
                        JobStatus::Failed,
                        Patch {
                            error: Some(error.clone()),
                            ..Patch::default()
                        },
                    )?;
                    if let Ok(log) = log {
                        let _ = log.append(JobEvent::Failed {
                            error,
                            status: None,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// Checks `config` for `kind`, records a `queued` row owned by `tenant`
    /// (submitted by key `submitted_by`) and schedules it.
    pub async fn submit(
        self: &Arc<Self>,
        kind: JobKind,
        config: Value,
        submitted_by: Option<String>,
        tenant: Option<String>,
    ) -> Result<JobRow, JobError> {
        let this = Arc::clone(self);
        blocking(move || {
            let spec = Spec::parse(kind, &config, &this.env())?;
            let row = this.ledger.submit(kind, config, submitted_by, tenant)?;
            this.launch(&row, spec)?;
            info!(job = %row.id, kind = %kind, "job submitted");
            Ok(row)
        })
        .await?
    }

    /// Runs a dataset pipeline (`steps`, as a `dataset` job's) over
    /// `records`, or over the first `limit` records of `input` (a file,
    /// folder or glob under the allowed paths) when given, writing nothing.
    pub async fn preview_dataset(
        self: &Arc<Self>,
        steps: Value,
        input: Option<String>,
        records: Vec<String>,
        limit: usize,
    ) -> Result<crate::datasets::Preview, JobError> {
        let this = Arc::clone(self);
        blocking(move || {
            let env = this.env();
            let pipeline = super::kinds::dataset::parse_steps(&steps, "steps", &env)?;
            let rows = match input {
                None => records
                    .into_iter()
                    .map(|text| crate::datasets::PreviewInput {
                        origin: None,
                        text,
                        unreadable: None,
                    })
                    .collect(),
                Some(raw) => super::kinds::dataset::read_head(&raw, &env, limit)?,
            };
            crate::datasets::Preview::run(&pipeline, rows)
                .map_err(|e| JobError::Config(ConfigError::new("steps", e.to_string())))
        })
        .await?
    }

    fn launch(self: &Arc<Self>, row: &JobRow, spec: Spec) -> Result<(), JobError> {
        let log = EventLog::open(Path::new(&row.log_path))
            .map_err(|e| JobError::Internal(format!("cannot open the job's event log: {e}")))?;
        let live = Arc::new(Live {
            kind: row.kind,
            log: Arc::new(log),
            cancel: Arc::new(AtomicBool::new(false)),
            notify: watch::Sender::new(0),
        });
        self.live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(row.id.clone(), Arc::clone(&live));
        let drive = Arc::clone(self).drive(row.id.clone(), spec, live);
        match self.runtime.get() {
            Some(rt) => rt.spawn(drive),
            None => tokio::spawn(drive),
        };
        Ok(())
    }

    async fn drive(self: Arc<Self>, id: String, spec: Spec, live: Arc<Live>) {
        let Some(slots) = self.slots.get(&live.kind).cloned() else {
            return;
        };
        let Ok(_permit) = slots.acquire_owned().await else {
            return;
        };
        if live.cancel.load(Ordering::Acquire) {
            // Cancelled while queued: `cancel` closed the row and the log
            // (or the gateway is stopping and the row stays queued).
            self.forget(&id);
            return;
        }
        if !self.mark_running(&id).await {
            self.forget(&id);
            return;
        }
        let ctx = JobCtx {
            id: id.clone(),
            log: Arc::clone(&live.log),
            ledger: Arc::clone(&self.ledger),
            cancel: Arc::clone(&live.cancel),
            notify: live.notify.clone(),
        };
        ctx.emit(JobEvent::Started {});
        let body = ctx.clone();
        let result = tokio::task::spawn_blocking(move || {
            std::panic::catch_unwind(AssertUnwindSafe(|| spec.run(&body)))
        })
        .await;
        let (status, event, patch) = match result {
            Ok(Ok(Ok(out))) => success(out),
            Ok(Ok(Err(RunError::Cancelled))) => self.cancelled(),
            Ok(Ok(Err(RunError::Failed(error)))) => failure(error),
            Ok(Err(panic)) => failure(format!("the job panicked: {}", panic_message(&*panic))),
            Err(e) => failure(format!("the job's thread was lost: {e}")),
        };
        // Row first, then the event: a follower that reads the terminal
        // event and then asks for the row sees it final.
        let ledger = Arc::clone(&self.ledger);
        let job = id.clone();
        match blocking(move || ledger.transition(&job, status, patch)).await {
            Ok(Ok(row)) => info!(job = %id, status = %row.status, "job finished"),
            Ok(Err(e)) => warn!(job = %id, error = %e, "cannot record the job's end"),
            Err(e) => warn!(job = %id, error = %e, "cannot record the job's end"),
        }
        ctx.emit(event);
        self.forget(&id);
    }

    /// Moves the job's row to `running`; false (logged) when it cannot
    /// start: the row was cancelled meanwhile, or the ledger failed.
    async fn mark_running(&self, id: &str) -> bool {
        let ledger = Arc::clone(&self.ledger);
        let job = id.to_owned();
        match blocking(move || ledger.transition(&job, JobStatus::Running, Patch::default())).await
        {
            Ok(Ok(_)) => true,
            Ok(Err(e)) => {
                info!(job = %id, reason = %e, "job not started");
                false
            }
            Err(e) => {
                warn!(job = %id, error = %e, "job not started");
                false
            }
        }
    }

    /// The end of a job stopped by `cancel` or by the gateway shutting down.
    fn cancelled(&self) -> (JobStatus, JobEvent, Patch) {
        let why = if self.stopping.load(Ordering::Acquire) {
            "cancelled: the gateway shut down"
        } else {
            "cancelled while running"
        };
        (
            JobStatus::Cancelled,
            JobEvent::Cancelled {
                message: Some(why.into()),
            },
            Patch {
                message: Some(why.into()),
                ..Patch::default()
            },
        )
    }

    /// Graceful stop: asks every running job to stop (they end `cancelled`)
    /// and leaves queued ones queued for the next start. Followers' streams
    /// end, so they do not hold the server's connection draining up.
    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::Release);
        let live: Vec<Arc<Live>> = self
            .live
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        for l in live {
            l.cancel.store(true, Ordering::Release);
            l.notify.send_modify(|_| {});
        }
    }

    /// Waits (at most `timeout`) for jobs to finish after [`Jobs::shutdown`];
    /// whatever still runs then is found `zombie` by the next start.
    pub async fn drain(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline
            && !self
                .live
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn get(&self, id: &str) -> Result<JobRow, JobError> {
        let ledger = Arc::clone(&self.ledger);
        let id = id.to_owned();
        Ok(blocking(move || ledger.get(&id)).await??)
    }

    pub async fn list(&self, filter: Filter, page: Page) -> Result<Listing, JobError> {
        let ledger = Arc::clone(&self.ledger);
        Ok(blocking(move || ledger.list(&filter, &page)).await??)
    }

    /// Cancels a queued job at once, or asks a running one to stop and waits
    /// (a few seconds at most) for it to do so; returns the row as it is then.
    pub async fn cancel(self: &Arc<Self>, id: &str) -> Result<JobRow, JobError> {
        let row = self.get(id).await?;
        if row.status.is_final() {
            return Err(JobError::Finished {
                id: row.id,
                status: row.status,
            });
        }
        let live = self.live(id);
        if let Some(l) = &live {
            l.cancel.store(true, Ordering::Release);
        }
        if row.status == JobStatus::Queued {
            let ledger = Arc::clone(&self.ledger);
            let job = id.to_owned();
            let patch = Patch {
                message: Some("cancelled before it started".into()),
                ..Patch::default()
            };
            let cancel = move || {
                ledger.transition_from(&job, Some(JobStatus::Queued), JobStatus::Cancelled, patch)
            };
            match blocking(cancel).await? {
                Ok(row) => {
                    let event = JobEvent::Cancelled {
                        message: Some("cancelled before it started".into()),
                    };
                    match &live {
                        Some(l) => {
                            if let Ok(s) = l.log.append(event) {
                                l.notify.send_replace(s.seq);
                            }
                        }
                        None => {
                            if let Ok(log) = EventLog::open(Path::new(&row.log_path)) {
                                let _ = log.append(event);
                            }
                        }
                    }
                    self.forget(id);
                    return Ok(row);
                }
                // It started in the meantime: stop it like a running one.
                Err(LedgerError::InvalidTransition { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut rx = live.map(|l| l.notify.subscribe());
        loop {
            let row = self.get(id).await?;
            if row.status.is_final() || Instant::now() >= deadline {
                return Ok(row);
            }
            match rx.as_mut() {
                Some(r) => {
                    if tokio::time::timeout(Duration::from_millis(100), r.changed())
                        .await
                        .is_ok_and(|c| c.is_err())
                    {
                        rx = None;
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    }

    /// The job's events after sequence number `after` (0: all): the stored
    /// ones first, then live ones as they come, ending after the terminal
    /// event (or when the job is final and its log has nothing more).
    pub async fn follow(
        self: &Arc<Self>,
        id: &str,
        after: u64,
    ) -> Result<impl Stream<Item = Followed> + Send + 'static, JobError> {
        let row = self.get(id).await?;
        let state = Follow {
            jobs: Arc::clone(self),
            id: row.id,
            reader: LogReader::new(&PathBuf::from(&row.log_path)),
            pending: VecDeque::new(),
            after,
            done: false,
            idle_since: Instant::now(),
            stop_grace: None,
        };
        Ok(futures_util::stream::unfold(state, |mut st| async move {
            st.next().await.map(|item| (item, st))
        }))
    }
}

/// The end of a job that finished its work.
fn success(out: super::kinds::Outcome) -> (JobStatus, JobEvent, Patch) {
    let output = out.output_path.map(|p| p.display().to_string());
    (
        JobStatus::Done,
        JobEvent::Done {
            output_dir: output.clone(),
            summary: out.summary.clone(),
        },
        Patch {
            message: Some("done".into()),
            output_path: output,
            summary: out.summary,
            ..Patch::default()
        },
    )
}

fn failure(error: String) -> (JobStatus, JobEvent, Patch) {
    (
        JobStatus::Failed,
        JobEvent::Failed {
            error: error.clone(),
            status: None,
        },
        Patch {
            message: Some("failed".into()),
            error: Some(error),
            ..Patch::default()
        },
    )
}

/// How long a follower waits without events before yielding `Idle`.
const IDLE_AFTER: Duration = Duration::from_secs(15);

struct Follow {
    jobs: Arc<Jobs>,
    id: String,
    reader: LogReader,
    pending: VecDeque<StoredEvent>,
    after: u64,
    done: bool,
    idle_since: Instant,
    /// When to give up once the gateway is stopping.
    stop_grace: Option<Instant>,
}

impl Follow {
    async fn next(&mut self) -> Option<Followed> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                if e.seq <= self.after {
                    continue;
                }
                self.after = e.seq;
                self.done |= e.event.is_terminal();
                self.idle_since = Instant::now();
                return Some(Followed::Event(e));
            }
            if self.done {
                return None;
            }
            if self.jobs.stopping.load(Ordering::Acquire) && self.stop_grace.is_none() {
                // Give the job's own closing event a moment to arrive.
                self.stop_grace = Some(Instant::now() + Duration::from_secs(2));
            }
            if self.stop_grace.is_some_and(|t| Instant::now() >= t) {
                return None;
            }
            if self.idle_since.elapsed() >= IDLE_AFTER {
                self.idle_since = Instant::now();
                return Some(Followed::Idle);
            }
            // Subscribe before reading, so nothing written in between is missed.
            let rx = self.jobs.live(&self.id).map(|l| l.notify.subscribe());
            match self.reader.read_new() {
                Ok(events) if !events.is_empty() => {
                    self.pending.extend(events);
                    continue;
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(job = %self.id, error = %e, "cannot read the job's event log");
                    return None;
                }
            }
            match rx {
                Some(mut rx) => {
                    let _ = tokio::time::timeout(Duration::from_secs(1), rx.changed()).await;
                }
                None => match self.jobs.get(&self.id).await {
                    Ok(row) if row.status.is_final() => {
                        // It will write nothing more: drain and stop.
                        self.pending
                            .extend(self.reader.read_new().unwrap_or_default());
                        self.done = true;
                    }
                    Ok(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    Err(_) => return None,
                },
            }
        }
    }
}
