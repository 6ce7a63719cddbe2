//! The pin policy: what to do about page-locking a piece of memory, decided once from the
//! value's `pin=` mode and whether a registration can be tried now, and the one place where
//! "strict fails, on falls back" is written.

use crate::config::PinMode;
use crate::stats::Counters;
use crate::Error;

/// What to do about page-locking memory just placed: decided once per piece of memory, from the
/// value's `pin=` mode and whether a registration can be tried now, and applied by
/// [`PinPolicy::settle`], the one place where "strict fails, on falls back" is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PinPolicy {
    /// `pin=off`: nothing is registered, and nothing fell back.
    Off,
    /// `pin=on`: registered; a failure serves the memory unpinned, counted.
    On,
    /// `pin=strict`: registered, or the memory fails.
    Strict,
    /// `pin=on` with nothing to register with now (no usable GPU for the target, or a
    /// registration failed lately): unpinned without trying, counted as a fallback.
    Backoff,
}

impl PinPolicy {
    /// The policy of `mode` when a registration can be tried (`can_register`); `pin=on`
    /// backs off when it cannot, `pin=strict` tries anyway (and fails).
    pub(crate) fn decide(mode: PinMode, can_register: bool) -> PinPolicy {
        match mode {
            PinMode::Off => PinPolicy::Off,
            PinMode::Strict => PinPolicy::Strict,
            PinMode::On if can_register => PinPolicy::On,
            PinMode::On => PinPolicy::Backoff,
        }
    }

    /// The policy of `mode` when a registration can be tried: what the value asked for.
    pub(crate) fn of(mode: PinMode) -> PinPolicy {
        PinPolicy::decide(mode, true)
    }

    /// The policy of a reservation of a kind that is `pinned` or not, or of a shared pool's
    /// registration (asked for explicitly, `pinned`): what it makes is what it promises, so a
    /// pinned kind's chunks register or fail (as `Strict`), and an unpinned kind's never ask
    /// (as `Off`: nothing fell back).
    pub(crate) fn reserving(pinned: bool) -> PinPolicy {
        if pinned {
            PinPolicy::Strict
        } else {
            PinPolicy::Off
        }
    }

    /// Whether pinning was asked for at all (`pin=on` or `pin=strict`).
    pub(crate) fn asked(self) -> bool {
        self != PinPolicy::Off
    }

    /// Whether a request must be page-locked or fail (`pin=strict`).
    pub(crate) fn strict(self) -> bool {
        self == PinPolicy::Strict
    }

    /// Whether a registration is tried.
    pub(crate) fn registers(self) -> bool {
        matches!(self, PinPolicy::On | PinPolicy::Strict)
    }

    /// Whether the memory ends up pinned, given the outcome of `register` (called only when
    /// [`Self::registers`]): under `Strict` a failure is the memory's; otherwise the memory is
    /// served unpinned, counted in `unpinned_blocks` unless nobody asked for pinning.
    pub(crate) fn settle(
        self,
        counters: &Counters,
        register: impl FnOnce() -> Result<(), Error>,
    ) -> Result<bool, Error> {
        let registered = if self.registers() {
            register()
        } else {
            Err(Error::PinningOff)
        };
        match registered {
            Ok(()) => Ok(true),
            Err(e) if self.strict() => Err(e),
            Err(_) => {
                if self.asked() {
                    counters.unpinned_blocks.incr();
                }
                Ok(false)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::PinPolicy;
    use crate::config::PinMode;
    use crate::stats::Counters;
    use crate::Error;

    fn failed() -> Result<(), Error> {
        Err(Error::PinningOff)
    }

    #[test]
    fn strict_fails_on_falls_back_off_never_asks() {
        let counters = Counters::default();
        let strict = PinPolicy::of(PinMode::Strict);
        assert_eq!(strict.settle(&counters, failed), Err(Error::PinningOff));
        assert_eq!(PinPolicy::decide(PinMode::Strict, false), PinPolicy::Strict);
        let on = PinPolicy::of(PinMode::On);
        assert_eq!(on.settle(&counters, failed), Ok(false));
        assert_eq!(on.settle(&counters, || Ok(())), Ok(true));
        assert_eq!(counters.unpinned_blocks.get(), 1, "on fell back once");
        let backoff = PinPolicy::decide(PinMode::On, false);
        assert_eq!(backoff, PinPolicy::Backoff);
        let mut tried = false;
        assert_eq!(
            backoff.settle(&counters, || {
                tried = true;
                Ok(())
            }),
            Ok(false)
        );
        assert!(!tried, "backing off tries no registration");
        assert_eq!(counters.unpinned_blocks.get(), 2, "a backoff is a fallback");
        let off = PinPolicy::of(PinMode::Off);
        assert_eq!(off.settle(&counters, || Ok(())), Ok(false));
        assert_eq!(
            counters.unpinned_blocks.get(),
            2,
            "off falls back from nothing"
        );
    }
}
