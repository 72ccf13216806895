//! `noop`: sleeps through `steps` steps of `delay_ms`, reporting each as a
//! stage and a metric. Exercises the runner, the ledger and the event stream
//! without touching a model.

use std::time::Duration;

use serde_json::{Map, json};

use super::{ConfigError, Fields, Outcome};
use crate::jobs::runner::{JobCtx, RunError};
use crate::jobs::types::JobEvent;

#[derive(Debug)]
pub struct NoopSpec {
    steps: u64,
    delay: Duration,
}

impl NoopSpec {
    pub fn parse(mut f: Fields) -> Result<NoopSpec, ConfigError> {
        let steps = f.u64("steps", Some(5), 0..=100_000)?;
        let delay_ms = f.u64("delay_ms", Some(100), 0..=600_000)?;
        f.finish()?;
        Ok(NoopSpec {
            steps,
            delay: Duration::from_millis(delay_ms),
        })
    }

    pub fn run(self, ctx: &JobCtx) -> Result<Outcome, RunError> {
        ctx.emit(JobEvent::stage(
            "start",
            Some(0.0),
            Some(format!("{} steps", self.steps)),
        ));
        for step in 1..=self.steps {
            ctx.sleep(self.delay)?;
            let progress = step as f64 / self.steps as f64;
            ctx.emit(JobEvent::stage(
                "step",
                Some(progress),
                Some(format!("step {step}/{}", self.steps)),
            ));
            ctx.emit(JobEvent::Metric {
                kind: "train".into(),
                step,
                loss: Some(1.0 / step as f64),
                progress: Some(progress),
                message: None,
                extra: Map::new(),
            });
        }
        Ok(Outcome {
            output_path: None,
            summary: Some(json!({ "steps": self.steps })),
        })
    }
}
