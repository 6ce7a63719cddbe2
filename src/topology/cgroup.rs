//! The cgroup v2 memory limits (`memory.max`, a container's memory limit) this process runs under.
//!
//! Populating a block beyond a cgroup's `memory.max` does not fail: the kernel's OOM killer ends a
//! process of the cgroup. So before a new block is populated, its size is compared with each
//! limited cgroup's room — `memory.max − memory.current`, plus its file pages (`active_file` +
//! `inactive_file` of `memory.stat`, which the kernel reclaims first) when that is not enough. A
//! block that does not fit fails with [`Error::MemoryLimit`], which makes the allocator give
//! cached blocks back and retry, and otherwise fail cleanly.
//!
//! Which cgroups are limited is found once, at initialisation (the process's cgroup and its
//! ancestors below the cgroup2 mount), and their `memory.max`, `memory.current` and
//! `memory.stat` opened then; they are read on every check from those descriptors (a check runs
//! inside an allocation: no `open`, no lock, no cancellation point there). cgroup v1's memory
//! controller is not read.

use std::path::{Path, PathBuf};

use super::sysfs::read_text;
use crate::sys::counters::CounterFile;
use crate::Error;

/// The limited cgroups of this process (none: no check).
#[derive(Debug, Default)]
pub(crate) struct MemoryLimits {
    cgroups: Vec<Limited>,
}

/// A limited cgroup: its folder (named in errors) and its counters, opened at initialisation.
#[derive(Debug)]
struct Limited {
    dir: PathBuf,
    max: CounterFile,
    current: CounterFile,
    stat: CounterFile,
}

impl Limited {
    fn open(dir: PathBuf) -> Limited {
        let file = |name: &str| {
            let file = CounterFile::new();
            file.open(&dir.join(name));
            file
        };
        Limited {
            max: file("memory.max"),
            current: file("memory.current"),
            stat: file("memory.stat"),
            dir,
        }
    }
}

impl MemoryLimits {
    /// The limits of this process, from `/proc/self/mountinfo` and `/proc/self/cgroup`. None when
    /// cgroup v2 is not mounted or no cgroup of the process has a `memory.max`.
    pub(crate) fn of_this_process() -> MemoryLimits {
        let mount = read_text(Path::new("/proc/self/mountinfo"))
            .ok()
            .and_then(|text| cgroup2_mount(&text));
        let own = read_text(Path::new("/proc/self/cgroup")).ok();
        match (mount, own) {
            (Some(mount), Some(own)) => MemoryLimits::under(&mount, &own),
            _ => MemoryLimits::default(),
        }
    }

    /// The limited cgroups on the path that `proc_self_cgroup` (the text of `/proc/self/cgroup`)
    /// names, under the cgroup2 mount `mount`.
    fn under(mount: &Path, proc_self_cgroup: &str) -> MemoryLimits {
        let Some(own) = proc_self_cgroup
            .lines()
            .find_map(|line| line.strip_prefix("0::"))
        else {
            return MemoryLimits::default();
        };
        let mut dir = mount.join(own.trim().trim_start_matches('/'));
        let mut cgroups = Vec::new();
        // The root cgroup has no memory.max.
        while dir.starts_with(mount) && dir != mount {
            let cgroup = Limited::open(dir.clone());
            if counter(&cgroup.max).is_some() {
                cgroups.push(cgroup);
            }
            if !dir.pop() {
                break;
            }
        }
        MemoryLimits { cgroups }
    }

    /// Whether `bytes` more can be charged without exceeding any limit; otherwise
    /// [`Error::MemoryLimit`] for the tightest one. A file that cannot be read (the cgroup was
    /// removed or moved) counts as no limit.
    pub(crate) fn check(&self, bytes: usize) -> Result<(), Error> {
        for cgroup in &self.cgroups {
            let (Some(max), Some(current)) = (counter(&cgroup.max), counter(&cgroup.current))
            else {
                continue;
            };
            let mut available = max.saturating_sub(current);
            if available < bytes {
                available = available.saturating_add(reclaimable(&cgroup.stat));
            }
            if available < bytes {
                return Err(Error::MemoryLimit {
                    cgroup: cgroup.dir.clone(),
                    limit: max,
                    available,
                    requested: bytes,
                });
            }
        }
        Ok(())
    }
}

/// The CPUs this process's cgroup lets it use (`cpuset.cpus.effective` of its cgroup v2), `None`
/// when there is no such file (no cgroup v2, or no cpuset there) or it cannot be read. Unlike a
/// thread's affinity, no thread of the process can narrow it.
pub(crate) fn allowed_cpus() -> Option<Vec<usize>> {
    let mount = cgroup2_mount(&read_text(Path::new("/proc/self/mountinfo")).ok()?)?;
    let own = read_text(Path::new("/proc/self/cgroup")).ok()?;
    let own = own.lines().find_map(|line| line.strip_prefix("0::"))?;
    let dir = mount.join(own.trim().trim_start_matches('/'));
    let text = read_text(&dir.join("cpuset.cpus.effective")).ok()?;
    super::sysfs::parse_list(text.trim()).ok()
}

/// The mount point of the cgroup2 file system in the text of `/proc/self/mountinfo`.
fn cgroup2_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // "36 25 0:31 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw": the type follows " - ".
        let (mount, fs) = line.split_once(" - ")?;
        let is_cgroup2 = fs.split_whitespace().next() == Some("cgroup2");
        is_cgroup2.then(|| mount.split_whitespace().nth(4).map(PathBuf::from))?
    })
}

/// The number a counter file holds (`None` for `max`, or when it cannot be read).
fn counter(file: &CounterFile) -> Option<usize> {
    let mut text = [0u8; 64];
    std::str::from_utf8(file.read(&mut text)?)
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// File pages of the cgroup (its `memory.stat`), which the kernel reclaims before it runs out of
/// memory.
fn reclaimable(stat: &CounterFile) -> usize {
    // memory.stat is about 1.5 KiB; the file counts are in its first lines.
    let mut text = [0u8; 8 << 10];
    let Some(stat) = stat.read(&mut text) else {
        return 0;
    };
    stat.split(|&b| b == b'\n')
        .filter_map(|line| std::str::from_utf8(line).ok()?.split_once(' '))
        .filter(|(key, _)| matches!(*key, "active_file" | "inactive_file"))
        .filter_map(|(_, value)| value.trim().parse::<usize>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use std::fs;

    use super::*;

    impl MemoryLimits {
        /// The limited cgroups' folders.
        fn dirs(&self) -> Vec<PathBuf> {
            self.cgroups.iter().map(|c| c.dir.clone()).collect()
        }
    }

    const MIB: usize = 1 << 20;

    #[test]
    fn finds_the_cgroup2_mount() {
        let mountinfo = "24 30 0:22 / /sys rw - sysfs sysfs rw\n\
                         35 24 0:30 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount(mountinfo),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(
            cgroup2_mount("24 30 0:22 / /sys rw - sysfs sysfs rw\n"),
            None
        );
    }

    /// A cgroup tree `root/a/b` where only `a` is limited (to 100 MiB, 60 MiB used, 30 MiB of
    /// file pages).
    fn tree(name: &str) -> PathBuf {
        let root = std::env::temp_dir().join(format!(
            "numa-gpu-alloc-cgroup-{name}-{}",
            std::process::id()
        ));
        let b = root.join("a/b");
        fs::create_dir_all(&b).unwrap();
        fs::write(b.join("memory.max"), "max\n").unwrap();
        fs::write(b.join("memory.current"), "1000\n").unwrap();
        let a = root.join("a");
        fs::write(a.join("memory.max"), format!("{}\n", 100 * MIB)).unwrap();
        fs::write(a.join("memory.current"), format!("{}\n", 60 * MIB)).unwrap();
        fs::write(
            a.join("memory.stat"),
            format!(
                "anon 1\nfile {}\nactive_file {}\ninactive_file {}\n",
                31 * MIB,
                10 * MIB,
                20 * MIB
            ),
        )
        .unwrap();
        root
    }

    #[test]
    fn checks_the_limited_ancestor_counting_file_pages() {
        let root = tree("ancestor");
        let limits = MemoryLimits::under(&root, "4:memory:/x\n0::/a/b\n");
        assert_eq!(limits.dirs(), [root.join("a")]);
        assert!(limits.check(40 * MIB).is_ok());
        assert!(
            limits.check(70 * MIB).is_ok(),
            "40 MiB free + 30 MiB of file pages"
        );
        match limits.check(71 * MIB) {
            Err(Error::MemoryLimit {
                cgroup,
                limit,
                available,
                requested,
            }) => {
                assert_eq!(cgroup, root.join("a"));
                assert_eq!(
                    (limit, available, requested),
                    (100 * MIB, 70 * MIB, 71 * MIB)
                );
            }
            other => panic!("{other:?}"),
        }
        fs::remove_dir_all(root).unwrap();
    }

    #[test]
    fn no_cgroup2_line_or_no_limit_means_no_check() {
        let root = tree("none");
        assert!(MemoryLimits::under(&root, "4:memory:/a\n")
            .cgroups
            .is_empty());
        assert!(MemoryLimits::under(&root, "0::/\n").cgroups.is_empty());
        assert_eq!(
            MemoryLimits::under(&root, "0::/a\n").dirs(),
            [root.join("a")]
        );
        fs::remove_dir_all(root).unwrap();
    }
}
