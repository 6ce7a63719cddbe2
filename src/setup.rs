//! What every initialisation shares (under the initialisation lock, `process::INIT`):
//! `NUMA_GPU_ALLOC`, parsed once per process, and the setup problems of the process printed so
//! far, so that each is printed once however many allocator values initialise.

use crate::config::{Settings, ENV_VAR};
use crate::Error;

/// The state behind [`process::INIT`](crate::process::INIT).
pub(crate) struct Setup {
    /// `NUMA_GPU_ALLOC`, parsed by the process's first initialisation.
    env: Option<Settings>,
    /// The process's problems printed so far (see [`Problems`]).
    printed: Vec<Error>,
}

impl Setup {
    /// Before the first initialisation.
    pub(crate) const NEW: Setup = Setup {
        env: None,
        printed: Vec::new(),
    };

    /// `NUMA_GPU_ALLOC`'s settings: read and parsed at the first call, the same for every value
    /// afterwards (a later change of the variable applies to none).
    pub(crate) fn env(&mut self) -> &Settings {
        self.env.get_or_insert_with(|| {
            let text = std::env::var_os(ENV_VAR).unwrap_or_default();
            Settings::parse(&text.to_string_lossy())
        })
    }
}

/// The setup problems of one value, each marked when it is the process's rather than the
/// value's own: one the environment caused applies to every value alike, so it is printed once
/// per process; one of the value's own settings is printed by that value.
#[derive(Default)]
pub(crate) struct Problems(Vec<(Error, bool)>);

impl Problems {
    pub(crate) fn add(&mut self, errors: impl IntoIterator<Item = Error>, process_wide: bool) {
        self.0
            .extend(errors.into_iter().map(|error| (error, process_wide)));
    }

    /// Every problem, and the ones to print: the value's own, and the process's that no value
    /// printed yet (recorded in `setup` as printed).
    pub(crate) fn sort_out(self, setup: &mut Setup) -> (Vec<Error>, Vec<Error>) {
        let mut unprinted = Vec::new();
        let mut all = Vec::with_capacity(self.0.len());
        for (error, process_wide) in self.0 {
            if !process_wide {
                unprinted.push(error.clone());
            } else if !setup.printed.contains(&error) {
                setup.printed.push(error.clone());
                unprinted.push(error.clone());
            }
            all.push(error);
        }
        (all, unprinted)
    }
}
