//! A step's lazily built graph written out as Graphviz dot (MLX's
//! `export_to_dot`), to compare its nodes with Python mlx-lm's step
//! (`scripts/gpu/graph_nodes.py`): on a GPU each node is a kernel launch or a
//! view, so a step with more nodes than mlx-lm's costs more at the same
//! weights. `MLXGATE_GRAPH_DOT=DIR` writes the eighth greedy decode step
//! of the GPU's slab for each batch width of a power of two there: the
//! first ones also build or grow the KV slab.

use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use mlx_rs::{Array, error::Exception};

/// Writes the unevaluated graph behind `outputs` to `path`.
pub fn export_to_dot(outputs: &[&Array], path: &Path) -> Result<(), Exception> {
    let raw: Vec<_> = outputs.iter().map(|a| a.as_ptr()).collect();
    let path = CString::new(path.to_string_lossy().as_bytes())
        .map_err(|_| Exception::custom("a dot path holds a NUL byte"))?;
    // SAFETY: every array in `raw` is live for the call, which only reads them.
    let status = unsafe { mlx_sys::mlxgate_export_to_dot(raw.as_ptr(), raw.len(), path.as_ptr()) };
    if status == 0 {
        Ok(())
    } else {
        Err(Exception::custom(format!(
            "could not write {}",
            path.to_string_lossy()
        )))
    }
}

/// The call of a name whose graph is written: past the steps that build or
/// grow the slab.
const DUMPED_CALL: u32 = 8;

/// Writes `outputs` as `MLXGATE_GRAPH_DOT/NAME.dot` at the eighth call with
/// `name` in this process, when that variable is set (`name` is made only
/// then); a failure is logged, never returned (the step goes on).
pub fn dump_once(name: impl FnOnce() -> String, outputs: &[&Array]) {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    static SEEN: OnceLock<Mutex<HashMap<String, u32>>> = OnceLock::new();
    let Some(dir) = DIR.get_or_init(|| std::env::var_os("MLXGATE_GRAPH_DOT").map(PathBuf::from))
    else {
        return;
    };
    let name = name();
    let due = SEEN
        .get_or_init(Default::default)
        .lock()
        .is_ok_and(|mut seen| {
            let calls = seen.entry(name.clone()).or_default();
            *calls += 1;
            *calls == DUMPED_CALL
        });
    if due {
        let path = dir.join(format!("{name}.dot"));
        match export_to_dot(outputs, &path) {
            Ok(()) => tracing::info!(path = %path.display(), "wrote a step's graph"),
            Err(error) => tracing::warn!(%error, "MLXGATE_GRAPH_DOT: no graph written"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lazy_graph_is_written_with_its_primitives() {
        let a = Array::from_slice(&[1.0f32, 2.0], &[2]);
        let b = Array::from_slice(&[3.0f32, 4.0], &[2]);
        let sum = a.add(&b).unwrap().multiply(&a).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("step.dot");
        export_to_dot(&[&sum], &path).unwrap();
        let dot = std::fs::read_to_string(&path).unwrap();
        assert!(dot.starts_with("digraph"), "{dot}");
        assert!(
            dot.contains(r#"label ="Add""#) && dot.contains(r#"label ="Multiply""#),
            "{dot}"
        );
        // Evaluated arrays are inputs, not nodes.
        sum.eval().unwrap();
        export_to_dot(&[&sum], &path).unwrap();
        assert!(!std::fs::read_to_string(&path).unwrap().contains("Add"));
        let missing = dir.path().join("no/such/dir/step.dot");
        assert!(export_to_dot(&[&sum], &missing).is_err());
    }
}
