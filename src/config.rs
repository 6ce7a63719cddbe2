//! Settings: the const builder's values and the `NUMA_GPU_ALLOC` environment override.
//!
//! Parsing is written by hand, like everything that runs inside the allocator (here: at its
//! initialisation, under the re-entrancy guard): no allocation through ourselves, no panic. Code
//! outside the allocator (examples, benches) uses libraries instead (lexopt, serde_json).

use crate::pci::PciAddress;
use crate::sys::{MemPolicy, MAX_NODES};
use crate::Error;

/// Default size at and above which requests take the placed, pinned path.
pub const DEFAULT_THRESHOLD: usize = 2 << 20;
/// Default limit of freed bytes a node's arena keeps cached (placed and pinned) for reuse, as each
/// allocator value applies it.
pub const DEFAULT_CACHE_LIMIT: usize = 4 << 30;
/// Smallest accepted threshold: one page.
pub const MIN_THRESHOLD: usize = 4 << 10;
/// Largest accepted threshold.
pub const MAX_THRESHOLD: usize = 64 << 30;
/// Default time after which idle free memory is given back (`decay=`).
pub const DEFAULT_DECAY_MS: u64 = 1000;
/// Name of the environment variable read once per process, by the first allocator value that
/// initialises; it applies to every value.
pub const ENV_VAR: &str = "NUMA_GPU_ALLOC";

/// Which GPU the allocator serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum GpuSelector {
    /// The launcher's local rank (`LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`,
    /// `MPI_LOCALRANKID`, first one set wins) modulo the visible device count, else device 0.
    Auto,
    /// CUDA device ordinal.
    Ordinal(u32),
    /// PCI address of the device; works without the CUDA driver (placement without pinning).
    Pci(PciAddress),
    /// CUDA device UUID (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, or `MIG-…` for a MIG
    /// instance).
    Uuid([u8; 16]),
    /// The device of the allocating thread's current CUDA context (`gpu=current`), read at each
    /// large allocation (`cuCtxGetCurrent`; the device is looked up once per context). A thread
    /// without a current context gets what the default target gives.
    Current,
}

/// Where large blocks go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Target {
    /// `GpuSelector::Auto` when the CUDA driver is present, else the node of the thread that
    /// makes the first large allocation.
    Default,
    /// The host node nearest this GPU.
    Gpu(GpuSelector),
    /// This NUMA node id, no GPU.
    Node(usize),
    /// The node of the CPU the allocating thread runs on, at each allocation (`node=local`, as
    /// tcmalloc's NUMA mode), no GPU. Threads bound with [`bind_thread`](crate::bind_thread)
    /// follow their route instead.
    LocalNode,
}

/// What to do about page-locking (`cuMemHostRegister`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PinMode {
    /// Pin; when registration fails keep the block unpinned and count it (`pin=on`).
    On,
    /// Every block handed out is page-locked, or the request fails: when its registration
    /// fails, and before anything is mapped when nothing can be page-locked for its target (no
    /// CUDA driver, no GPU for the target, a forked child; said once on stderr, counted in
    /// [`Fallbacks::strict_refused`](crate::Fallbacks::strict_refused)).
    Strict,
    /// Never pin (the default): copies from and to these blocks stay synchronous.
    Off,
}

/// Blocks placed (and pinned, when pinning is on) into the cache at initialisation, so that the
/// first requests of that size are cache hits (`reserve=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Reserve {
    /// How many blocks (0: none).
    pub blocks: usize,
    /// Bytes of each: a request of this size, or up to a ninth smaller, reuses one.
    pub block_size: usize,
}

impl Reserve {
    /// No reservation (the default).
    pub const NONE: Reserve = Reserve {
        blocks: 0,
        block_size: 0,
    };
}

/// What an allocator prints about itself when the process exits (`stats=`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StatsAtExit {
    /// Nothing (the default).
    Off,
    /// The [`Stats`](crate::Stats) table, to stderr (`stats=exit`).
    Table,
    /// [`Stats::json`](crate::Stats::json) on one line, to stderr (`stats=json`).
    Json,
}

/// All settings of a [`NumaGpuAlloc`](crate::NumaGpuAlloc).
///
/// Start from [`Config::DEFAULT`] (or `Config::default()`) and set fields: more may be added.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Requests of at least this many bytes take the large path.
    pub threshold: usize,
    /// Where large blocks are placed.
    pub target: Target,
    /// NUMA policy of large blocks.
    pub policy: MemPolicy,
    /// Freed bytes a node's arena keeps cached before the oldest blocks are released (applied by
    /// this value when it frees or allocates on that node).
    pub cache_limit: usize,
    /// `MADV_HUGEPAGE` and 2 MiB alignment for blocks of at least 2 MiB.
    pub huge_pages: bool,
    /// Check every page's node with `move_pages` after populating.
    pub verify: bool,
    /// Page-locking mode.
    pub pin: PinMode,
    /// Register with `CU_MEMHOSTREGISTER_DEVICEMAP`.
    pub pin_devicemap: bool,
    /// Register with `CU_MEMHOSTREGISTER_READ_ONLY`.
    pub pin_read_only: bool,
    /// The most bytes the process keeps page-locked through the allocator (`usize::MAX`: no
    /// limit); past it `pin=on` serves blocks unpinned, `pin=strict` fails them.
    pub pin_limit: usize,
    /// Threads that populate one large block or chunk, the caller's among them (the others are
    /// the node's pooled workers); 0: the CPUs this process may use, at most 8 (more rarely
    /// help: the kernel's page clearing saturates a node's memory bandwidth).
    pub populate_threads: usize,
    /// Root of sysfs (`/sys`); tests point it at fixture trees.
    pub sysfs_root: &'static str,
    /// Whether the stats are printed at process exit, and how.
    pub stats_at_exit: StatsAtExit,
    /// Blocks placed into the cache at initialisation.
    pub reserve: Reserve,
    /// Milliseconds after which idle free memory is given back to the kernel (`u64::MAX`: never).
    pub decay_ms: u64,
    /// A thread that gives idle memory back while the program allocates nothing large.
    pub decay_thread: bool,
}

impl Config {
    /// The defaults: 2 MiB threshold, default target, `preferred` policy, 4 GiB cache, huge
    /// pages on, no verification, no pinning, automatic threads.
    pub const DEFAULT: Config = Config {
        threshold: DEFAULT_THRESHOLD,
        target: Target::Default,
        policy: MemPolicy::Preferred,
        cache_limit: DEFAULT_CACHE_LIMIT,
        huge_pages: true,
        verify: false,
        pin: PinMode::Off,
        pin_devicemap: false,
        pin_read_only: false,
        pin_limit: usize::MAX,
        populate_threads: 0,
        sysfs_root: "/sys",
        stats_at_exit: StatsAtExit::Off,
        reserve: Reserve::NONE,
        decay_ms: DEFAULT_DECAY_MS,
        decay_thread: true,
    };

    /// Applies a `NUMA_GPU_ALLOC`-style string (`key=value,key=value`). Entries that are
    /// rejected leave their setting unchanged and are returned; the rest apply.
    pub fn apply_settings(&mut self, settings: &str) -> Vec<Error> {
        let parsed = Settings::parse(settings);
        parsed.apply_to(self);
        parsed.errors
    }

    /// Applies one setting; on error the configuration is unchanged.
    pub fn apply(&mut self, key: &str, value: &str) -> Result<(), Error> {
        self.set(parse_setting(key, value)?);
        Ok(())
    }

    fn set(&mut self, setting: Setting) {
        match setting {
            Setting::Threshold(bytes) => self.threshold = bytes,
            Setting::Target(target) => self.target = target,
            Setting::Policy(policy) => self.policy = policy,
            Setting::CacheLimit(bytes) => self.cache_limit = bytes,
            Setting::HugePages(on) => self.huge_pages = on,
            Setting::Verify(on) => self.verify = on,
            Setting::Pin(mode) => self.pin = mode,
            Setting::PinDevicemap(on) => self.pin_devicemap = on,
            Setting::PinReadOnly(on) => self.pin_read_only = on,
            Setting::PinLimit(bytes) => self.pin_limit = bytes,
            Setting::PopulateThreads(threads) => self.populate_threads = threads,
            Setting::StatsAtExit(format) => self.stats_at_exit = format,
            Setting::Reserve(reserve) => self.reserve = reserve,
            Setting::DecayMs(ms) => self.decay_ms = ms,
            Setting::DecayThread(on) => self.decay_thread = on,
        }
    }
}

/// One accepted entry, parsed: what it sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Setting {
    Threshold(usize),
    /// `node=` or `gpu=`.
    Target(Target),
    Policy(MemPolicy),
    CacheLimit(usize),
    HugePages(bool),
    Verify(bool),
    Pin(PinMode),
    PinDevicemap(bool),
    PinReadOnly(bool),
    PinLimit(usize),
    PopulateThreads(usize),
    StatsAtExit(StatsAtExit),
    Reserve(Reserve),
    DecayMs(u64),
    DecayThread(bool),
}

/// A `NUMA_GPU_ALLOC`-style string, parsed: the accepted entries in order (a later one of the
/// same key applies over an earlier one), and the rejected ones.
#[derive(Debug, Default)]
pub(crate) struct Settings {
    accepted: Vec<Setting>,
    pub(crate) errors: Vec<Error>,
}

impl Settings {
    pub(crate) fn parse(settings: &str) -> Settings {
        let mut parsed = Settings::default();
        let mut seen: Vec<&str> = Vec::new();
        for entry in settings.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let Some((key, value)) = entry.split_once('=') else {
                parsed.errors.push(config_error(entry, "", "key=value"));
                continue;
            };
            let (key, value) = (key.trim(), value.trim());
            if seen.contains(&key) {
                parsed.errors.push(config_error(
                    key,
                    value,
                    "each key once (the last value given applies)",
                ));
            }
            seen.push(key);
            match parse_setting(key, value) {
                Ok(setting) => parsed.accepted.push(setting),
                Err(e) => parsed.errors.push(e),
            }
        }
        if seen.contains(&"node") && seen.contains(&"gpu") {
            parsed.errors.push(config_error(
                "node",
                "",
                "either node= or gpu=, not both (the later one applies)",
            ));
        }
        parsed
    }

    /// Applies the accepted entries to `config`, in order.
    pub(crate) fn apply_to(&self, config: &mut Config) {
        for &setting in &self.accepted {
            config.set(setting);
        }
    }

    /// Whether an accepted entry is one of those `which` picks.
    pub(crate) fn sets(&self, which: fn(&Setting) -> bool) -> bool {
        self.accepted.iter().any(which)
    }
}

/// Parses one entry (see [`Config::apply`]).
fn parse_setting(key: &str, value: &str) -> Result<Setting, Error> {
    Ok(match key {
        "threshold" => Setting::Threshold(parse_threshold(value)?),
        "node" if value == "local" => Setting::Target(Target::LocalNode),
        "node" => Setting::Target(Target::Node(parse_node(value)?)),
        "gpu" => Setting::Target(Target::Gpu(parse_gpu(value)?)),
        "policy" => Setting::Policy(parse_policy(value)?),
        "cache" => Setting::CacheLimit(
            parse_size(value).ok_or_else(|| config_error(key, value, SIZE_FORMAT))?,
        ),
        "huge" => Setting::HugePages(parse_switch(key, value)?),
        "verify" => Setting::Verify(parse_switch(key, value)?),
        "pin" => Setting::Pin(parse_pin(value)?),
        "devicemap" => Setting::PinDevicemap(parse_switch(key, value)?),
        "readonly" => Setting::PinReadOnly(parse_switch(key, value)?),
        "pin_limit" if value == "none" => Setting::PinLimit(usize::MAX),
        "pin_limit" => Setting::PinLimit(
            parse_size(value).ok_or_else(|| config_error(key, value, PIN_LIMIT_FORMAT))?,
        ),
        "threads" => Setting::PopulateThreads(parse_threads(value)?),
        "stats" => Setting::StatsAtExit(parse_stats(value)?),
        "reserve" => Setting::Reserve(parse_reserve(value)?),
        "decay" => Setting::DecayMs(parse_decay(value)?),
        "decay_thread" => Setting::DecayThread(parse_switch(key, value)?),
        _ => {
            return Err(config_error(
                key,
                value,
                "one of threshold, node, gpu, policy, cache, huge, verify, pin, devicemap, \
                 readonly, pin_limit, threads, stats, reserve, decay, decay_thread",
            ))
        }
    })
}

impl Default for Config {
    fn default() -> Self {
        Config::DEFAULT
    }
}

const SIZE_FORMAT: &str = "a size such as 4096, 512KiB, 4MiB or 8GiB";
const PIN_LIMIT_FORMAT: &str = "a size such as 512MiB or 64GiB, or none";

pub(crate) fn config_error(key: &str, value: &str, expected: &'static str) -> Error {
    Error::Config {
        key: key.to_owned(),
        value: value.to_owned(),
        expected,
    }
}

/// Parses `4096`, `512KiB`, `4MiB`, `8GiB`, `1TiB` (also `K`/`KB`/`M`/`MB`/... as binary units,
/// case-insensitive; spaces around the unit are fine). `None` on garbage, control characters or
/// overflow.
pub fn parse_size(value: &str) -> Option<usize> {
    // Trimming below would otherwise skip a newline or tab between number and unit.
    if value.contains(char::is_control) {
        return None;
    }
    let value = value.trim();
    let split = value
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(value.len());
    let (digits, unit) = value.split_at(split);
    let number: usize = digits.parse().ok()?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return None,
    };
    number.checked_mul(1usize.checked_shl(shift)?)
}

/// Parses a `threshold=` value and checks its range.
pub fn parse_threshold(value: &str) -> Result<usize, Error> {
    match parse_size(value) {
        Some(t) if (MIN_THRESHOLD..=MAX_THRESHOLD).contains(&t) => Ok(t),
        _ => Err(config_error(
            "threshold",
            value,
            "a size from 4KiB to 64GiB, such as 2MiB",
        )),
    }
}

fn parse_node(value: &str) -> Result<usize, Error> {
    match value.parse::<usize>() {
        Ok(n) if n < MAX_NODES => Ok(n),
        _ => Err(config_error(
            "node",
            value,
            "a NUMA node id from 0 to 1023 (an online node of this machine), or local",
        )),
    }
}

/// Parses a `gpu=` selector: `auto`, `current`, an ordinal (`0`), `pci:0000:81:00.0`, or a UUID
/// as `nvidia-smi -L` prints it (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, or `MIG-…` for a MIG
/// instance).
pub fn parse_gpu(value: &str) -> Result<GpuSelector, Error> {
    const EXPECTED: &str = "auto, current, a device ordinal (0), pci:DOMAIN:BUS:DEV.FN \
                            (pci:0000:81:00.0) or a UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)";
    let bad = || config_error("gpu", value, EXPECTED);
    if value.eq_ignore_ascii_case("auto") {
        Ok(GpuSelector::Auto)
    } else if value.eq_ignore_ascii_case("current") {
        Ok(GpuSelector::Current)
    } else if let Some(addr) = value.strip_prefix("pci:") {
        addr.parse().map(GpuSelector::Pci).map_err(|_| bad())
    } else if let Some(uuid) =
        strip_prefix_ignore_case(value, "GPU-").or_else(|| strip_prefix_ignore_case(value, "MIG-"))
    {
        parse_uuid(uuid).map(GpuSelector::Uuid).ok_or_else(bad)
    } else {
        value.parse().map(GpuSelector::Ordinal).map_err(|_| bad())
    }
}

fn strip_prefix_ignore_case<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let head = text.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &text[prefix.len()..])
}

/// Parses the 32 hex digits of a UUID, with or without dashes in the usual places.
fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let mut bytes = [0u8; 16];
    let mut digits = text.chars().filter(|&c| c != '-');
    for byte in &mut bytes {
        let hi = digits.next()?.to_digit(16)?;
        let lo = digits.next()?.to_digit(16)?;
        *byte = u8::try_from(hi * 16 + lo).ok()?;
    }
    let dashes_ok = text.len() == 32 || text.len() == 36;
    (digits.next().is_none() && dashes_ok).then_some(bytes)
}

fn parse_policy(value: &str) -> Result<MemPolicy, Error> {
    match value.to_ascii_lowercase().as_str() {
        "preferred" => Ok(MemPolicy::Preferred),
        "bind" => Ok(MemPolicy::Bind),
        "interleave" => Ok(MemPolicy::Interleave),
        _ => Err(config_error(
            "policy",
            value,
            "preferred, bind or interleave",
        )),
    }
}

fn parse_pin(value: &str) -> Result<PinMode, Error> {
    match value.to_ascii_lowercase().as_str() {
        // `fallback` was this mode's name before pinning became opt-in.
        "on" | "fallback" => Ok(PinMode::On),
        "strict" => Ok(PinMode::Strict),
        "off" => Ok(PinMode::Off),
        _ => Err(config_error("pin", value, "on, strict or off")),
    }
}

fn parse_switch(key: &str, value: &str) -> Result<bool, Error> {
    match value.to_ascii_lowercase().as_str() {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(config_error(key, value, "on or off")),
    }
}

fn parse_stats(value: &str) -> Result<StatsAtExit, Error> {
    match value.to_ascii_lowercase().as_str() {
        "off" => Ok(StatsAtExit::Off),
        "exit" => Ok(StatsAtExit::Table),
        "json" => Ok(StatsAtExit::Json),
        _ => Err(config_error(
            "stats",
            value,
            "exit (the table at exit), json (JSON at exit) or off",
        )),
    }
}

/// Parses a `reserve=` value: `COUNTxSIZE` (`8x64MiB`), `SIZE` (one block) or `0` (none).
fn parse_reserve(value: &str) -> Result<Reserve, Error> {
    let (blocks, size) = match value.split_once(['x', 'X']) {
        Some((count, size)) => (count.trim().parse().ok(), parse_size(size)),
        None => (Some(1), parse_size(value)),
    };
    match (blocks, size) {
        (Some(0), Some(_)) | (Some(_), Some(0)) => Ok(Reserve::NONE),
        (Some(blocks), Some(block_size)) => Ok(Reserve { blocks, block_size }),
        _ => Err(config_error(
            "reserve",
            value,
            "COUNTxSIZE such as 8x64MiB, a size (one block) or 0",
        )),
    }
}

/// Parses a `decay=` value: milliseconds (`500`, `500ms`), seconds (`2s`), or `off` (never).
fn parse_decay(value: &str) -> Result<u64, Error> {
    let lower = value.to_ascii_lowercase();
    let (digits, scale) = if lower == "off" || lower == "never" {
        return Ok(u64::MAX);
    } else if let Some(ms) = lower.strip_suffix("ms") {
        (ms, 1)
    } else if let Some(s) = lower.strip_suffix('s') {
        (s, 1000)
    } else {
        (lower.as_str(), 1)
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| {
            config_error(
                "decay",
                value,
                "milliseconds (500, 500ms), seconds (2s) or off",
            )
        })
}

fn parse_threads(value: &str) -> Result<usize, Error> {
    if value.eq_ignore_ascii_case("auto") {
        return Ok(0);
    }
    match value.parse::<usize>() {
        Ok(n) if (1..=1024).contains(&n) => Ok(n),
        _ => Err(config_error(
            "threads",
            value,
            "auto or a thread count from 1 to 1024",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key_of(e: &Error) -> &str {
        match e {
            Error::Config { key, .. } => key,
            other => panic!("not a config error: {other:?}"),
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("4MiB"), Some(4 << 20));
        assert_eq!(parse_size("8gib"), Some(8 << 30));
        assert_eq!(parse_size("512K"), Some(512 << 10));
        assert_eq!(parse_size("1TiB"), Some(1 << 40));
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("MiB"), None);
        assert_eq!(parse_size("4 PiB"), None);
        assert_eq!(parse_size(" 4 MiB "), Some(4 << 20));
        for control in ["4\nMiB", "4\tMiB", "4MiB\n", "\u{1b}4MiB"] {
            assert_eq!(parse_size(control), None, "{control:?}");
        }
        assert_eq!(parse_size("99999999999999999999"), None);
        assert_eq!(parse_size("18446744073709551615GiB"), None);
    }

    #[test]
    fn targets_that_follow_the_thread() {
        let mut c = Config::DEFAULT;
        assert!(c.apply_settings("node=local").is_empty());
        assert_eq!(c.target, Target::LocalNode);
        assert!(c.apply_settings("gpu=current").is_empty());
        assert_eq!(c.target, Target::Gpu(GpuSelector::Current));
    }

    #[test]
    fn full_example_applies() {
        let mut c = Config::DEFAULT;
        let errors =
            c.apply_settings("threshold=4MiB,node=1,policy=bind,cache=8GiB,huge=off,verify=on");
        assert!(errors.is_empty(), "{errors:?}");
        assert_eq!(c.threshold, 4 << 20);
        assert_eq!(c.target, Target::Node(1));
        assert_eq!(c.policy, MemPolicy::Bind);
        assert_eq!(c.cache_limit, 8 << 30);
        assert!(!c.huge_pages);
        assert!(c.verify);
    }

    #[test]
    fn bad_entries_are_reported_and_the_rest_applies() {
        let mut c = Config::DEFAULT;
        let errors = c.apply_settings("threshold=0,cache=1GiB,bogus=1,node=99999,policy=strict");
        let keys: Vec<&str> = errors.iter().map(key_of).collect();
        assert_eq!(keys, ["threshold", "bogus", "node", "policy"]);
        assert_eq!(c.threshold, DEFAULT_THRESHOLD);
        assert_eq!(c.cache_limit, 1 << 30);
        assert_eq!(c.target, Target::Default);
        let text = errors[0].to_string();
        assert!(text.contains("threshold") && text.contains("\"0\"") && text.contains("4KiB"));
    }

    #[test]
    fn out_of_range_duplicates_and_conflicts() {
        let mut c = Config::DEFAULT;
        assert_eq!(c.apply_settings("threshold=1TiB").len(), 1);
        let errors = c.apply_settings("huge=off,huge=on");
        assert_eq!(errors.len(), 1);
        assert!(c.huge_pages, "the last value applies");
        let errors = c.apply_settings("node=1,gpu=pci:0000:81:00.0");
        assert_eq!(errors.len(), 1);
        assert!(matches!(c.target, Target::Gpu(GpuSelector::Pci(_))));
        assert!(c.apply_settings("").is_empty());
        assert!(c.apply_settings(",,, ,").is_empty());
        assert_eq!(c.apply_settings("novalue").len(), 1);
    }

    #[test]
    fn stats_at_exit() {
        let mut c = Config::DEFAULT;
        assert_eq!(c.stats_at_exit, StatsAtExit::Off);
        assert!(c.apply_settings("stats=exit").is_empty());
        assert_eq!(c.stats_at_exit, StatsAtExit::Table);
        assert!(c.apply_settings("stats=JSON").is_empty());
        assert_eq!(c.stats_at_exit, StatsAtExit::Json);
        let errors = c.apply_settings("stats=on");
        assert_eq!(errors.iter().map(key_of).collect::<Vec<_>>(), ["stats"]);
        assert_eq!(
            c.stats_at_exit,
            StatsAtExit::Json,
            "a rejected value changes nothing"
        );
    }

    #[test]
    fn reserve_values() {
        let reserve = |value| parse_reserve(value).map(|r| (r.blocks, r.block_size));
        assert_eq!(reserve("8x64MiB"), Ok((8, 64 << 20)));
        assert_eq!(reserve(" 2 X 1GiB"), Ok((2, 1 << 30)));
        assert_eq!(reserve("256MiB"), Ok((1, 256 << 20)));
        assert_eq!(reserve("0"), Ok((0, 0)));
        assert_eq!(reserve("0x4MiB"), Ok((0, 0)));
        for bad in ["", "x4MiB", "4x", "-1x4MiB", "4MiBx2", "lots"] {
            assert!(parse_reserve(bad).is_err(), "{bad}");
        }
        let mut c = Config::DEFAULT;
        assert!(c.apply_settings("reserve=4x8MiB").is_empty());
        assert_eq!(
            c.reserve,
            Reserve {
                blocks: 4,
                block_size: 8 << 20
            }
        );
    }

    #[test]
    fn gpu_selectors() {
        assert_eq!(parse_gpu("auto"), Ok(GpuSelector::Auto));
        assert_eq!(parse_gpu("current"), Ok(GpuSelector::Current));
        assert_eq!(parse_gpu("3"), Ok(GpuSelector::Ordinal(3)));
        let uuid = parse_gpu("GPU-00112233-4455-6677-8899-aabbccddeeff").unwrap();
        assert_eq!(
            uuid,
            GpuSelector::Uuid([
                0x00, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd,
                0xee, 0xff
            ])
        );
        assert_eq!(
            parse_gpu("MIG-00112233-4455-6677-8899-aabbccddeeff"),
            Ok(uuid),
            "a MIG instance's UUID"
        );
        assert!(parse_gpu("GPU-0011").is_err());
        assert!(parse_gpu("pci:zz").is_err());
        assert!(parse_gpu("-1").is_err());
        assert!(parse_gpu("GPU-ééé").is_err());
        assert!(parse_gpu("aéé").is_err());
    }
}
