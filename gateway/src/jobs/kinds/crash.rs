//! `crash`: fails on purpose (`mode: "error"`) or panics (`mode: "panic"`),
//! after `after_ms`. Only with `[jobs] enable_crash = true`: it exists to
//! show that a failing job becomes `failed` while the gateway keeps serving.

use std::time::Duration;

use super::{ConfigError, Fields, Outcome};
use crate::jobs::runner::{JobCtx, RunError};
use crate::jobs::types::JobEvent;

#[derive(Debug)]
pub struct CrashSpec {
    panic: bool,
    after: Duration,
}

impl CrashSpec {
    pub fn parse(mut f: Fields) -> Result<CrashSpec, ConfigError> {
        let panic = f.choice("mode", &[("error", false), ("panic", true)])?;
        let after_ms = f.u64("after_ms", Some(0), 0..=600_000)?;
        f.finish()?;
        Ok(CrashSpec {
            panic,
            after: Duration::from_millis(after_ms),
        })
    }

    pub fn run(self, ctx: &JobCtx) -> Result<Outcome, RunError> {
        ctx.emit(JobEvent::stage(
            "crash",
            Some(0.5),
            Some("about to crash".into()),
        ));
        ctx.sleep(self.after)?;
        if self.panic {
            panic!("crash job panicked on purpose");
        }
        Err(RunError::Failed("crash job failed on purpose".into()))
    }
}
