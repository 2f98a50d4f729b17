"""Will the cluster ever run this request? Asked before anything is queued (submit.sh, through
`llmtrain check-config --cluster`), from Slurm's own view of its partitions and nodes (`sinfo`).

A request no node or partition can meet would sit PENDING forever (Slurm accepts 8 CPUs per
node on a cluster of 2-CPU nodes, or a time above the partition's limit, and waits). Each such
key is one line: what the config asks, what the partition offers, what to change.

    problems = cluster_problems(cfg)    # [] when the request fits, or when there is no sinfo

Judged by: the nodes of the partition (`sinfo -N`: CPUs, memory, GPUs, the time limit); the
partition's own rules (`scontrol show partition`: AllowAccounts/DenyAccounts, AllowQos/DenyQos,
MaxNodes), AllowAccounts against the account Slurm would charge (the user's default account
where none is given; none at all where `scontrol show config` says the cluster keeps no
accounting); and where Slurm keeps accounting (`sacctmgr`, which answers only then), the user's
associations (may this user charge slurm.account?) and the QOS's limits (MaxWall, and nodes or
GPUs per job in MaxTRESPerJob). What none of them shows is left to sbatch.
"""

from __future__ import annotations

import getpass
import re
import subprocess
from dataclasses import dataclass

from ..config import Config
from ..config import slurm_seconds as seconds
from ..metrics import plural

SINFO_FORMAT = "%N|%P|%c|%m|%G|%l"  # node, partition (* = default), CPUs, memory (MB), gres, time limit


@dataclass(frozen=True)
class Node:
    name: str
    partition: str
    default: bool
    cpus: int
    mem_mb: int
    gpus: int
    time_limit_s: float  # the partition's; inf: none


def cluster_problems(cfg: Config) -> list[str]:
    out = _sinfo()
    if out is None:
        return []  # no Slurm client here: sbatch itself will say so
    nodes = parse_sinfo(out)
    if not nodes:
        return []  # sinfo shows nothing it can judge by (a federation, a restricted view)
    s = cfg.slurm
    partitions = sorted({n.partition for n in nodes})
    if s.partition is None:
        default = sorted({n.partition for n in nodes if n.default})
        if not default:
            return [f"slurm.partition: the cluster has no default partition; choose one of "
                    f"{', '.join(partitions) or 'none'}"]
        partition, key = default[0], f"the default partition {default[0]}"
    else:
        partition, key = s.partition, f"partition {s.partition}"
        if partition not in partitions:
            return [f"slurm.partition: no partition {partition!r} on this cluster; choose one of "
                    f"{', '.join(partitions) or 'none'}"]
    members = [n for n in nodes if n.partition == partition]
    p = []
    most = max(n.cpus for n in members)
    if s.cpus_per_node > most:
        p.append(f"slurm.cpus_per_node: asks {s.cpus_per_node} CPUs per node; the nodes of {key} have "
                 f"at most {most}; set slurm.cpus_per_node <= {most}")
    gpus = max(n.gpus for n in members)
    if s.gpus_per_node > gpus:
        has = f"at most {gpus}" if gpus else "none"
        p.append(f"slurm.gpus_per_node: asks {plural(s.gpus_per_node, 'GPU')} per node; the nodes of {key} have "
                 f"{has}; choose a GPU partition (slurm.partition) or set slurm.gpus_per_node <= {gpus}")
    mem = mem_mb(s.mem)
    most_mem = max(n.mem_mb for n in members)
    if mem and mem > most_mem:
        p.append(f"slurm.mem: asks {s.mem} per node; the nodes of {key} have at most {most_mem} MB")
    fit = [n for n in members if n.cpus >= s.cpus_per_node and n.gpus >= s.gpus_per_node
           and n.mem_mb >= mem]
    if not p and len(fit) < s.nodes:
        p.append(f"slurm.nodes: asks {plural(s.nodes, 'node')} with {plural(s.cpus_per_node, 'CPU')} and "
                 f"{plural(s.gpus_per_node, 'GPU')} each; {key} has {plural(len(fit), 'such node')} "
                 f"({len(members)} in all)")
    limit = members[0].time_limit_s
    if seconds(s.time) > limit:
        p.append(f"slurm.time: asks {s.time}; {key} allows at most {format_limit(limit)}; lower "
                 f"slurm.time (a requeue continues the run) or choose another partition")
    rules = _partition_rules(partition)
    p += job_account_problems(cfg, key, rules, _accounting_storage, _sacctmgr)
    p += partition_problems(cfg, partition, key, rules)
    return p + accounting_problems(cfg, _sacctmgr)


def job_account_problems(cfg: Config, key: str, rules: dict[str, str], accounting_storage,
                         sacctmgr) -> list[str]:
    """A partition with AllowAccounts judges the account of the job's *association*
    (slurmctld's part_policy_valid_acct gets `assoc_ptr->acct`, NULL without one), not the
    `--account` text: with no account given Slurm takes the user's default account, and where
    Slurm keeps no accounting no job has an association, so every job, --account or not, pends
    forever ("Job's account not known, so it can't use this partition"). sbatch accepts both.
    accounting_storage() -> `scontrol show config`'s AccountingStorageType, or None;
    sacctmgr(args) -> its -nP output, or None."""
    s = cfg.slurm
    allowed = _names(rules.get("AllowAccounts", "ALL"))
    if allowed is None or (s.account and s.account not in allowed):
        return []  # any account goes, or partition_problems names the account it refuses
    only = f"{key} allows only accounts {', '.join(allowed)}"
    storage = accounting_storage()
    if storage is not None and storage.removeprefix("accounting_storage/") in ("none", "(null)", ""):
        return [f"slurm.account: {only}, and this cluster keeps no accounting (AccountingStorageType="
                f"{storage or '(null)'}), so Slurm never knows a job's account and the job would pend "
                f"forever; choose another partition (slurm.partition)"]
    if s.account:
        return []
    default = default_account(sacctmgr)
    if default is None or default in allowed:
        return []  # sacctmgr does not answer (sbatch decides), or the default is allowed
    return [f"slurm.account: {only}, and no account is given (your default: {default or 'none'}); "
            f"set slurm.account"]


def default_account(sacctmgr) -> str | None:
    """The account Slurm charges when --account is not given (`sacctmgr show user`'s
    DefaultAccount); "" for a user without one, None where sacctmgr does not answer."""
    user = _user()
    out = sacctmgr(["show", "user", user, "format=DefaultAccount"]) if user else None
    if out is None:
        return None
    return next((line.strip() for line in out.splitlines() if line.strip()), "")


def partition_problems(cfg: Config, partition: str, key: str, rules: dict[str, str]) -> list[str]:
    """The partition's rules (`scontrol show partition -o` fields) against the request."""
    s, p = cfg.slurm, []
    for what, value, allow, deny in (("account", s.account, "AllowAccounts", "DenyAccounts"),
                                     ("qos", s.qos, "AllowQos", "DenyQos")):
        allowed, denied = _names(rules.get(allow, "ALL")), _names(rules.get(deny, "")) or []
        if value and ((allowed is not None and value not in allowed) or value in denied):
            offer = f"allows {', '.join(allowed)}" if allowed is not None else f"denies {value!r}"
            p.append(f"slurm.{what}: {key} does not take {what} {value!r} ({offer}); choose another "
                     f"{what if what == 'account' else 'QOS'} or another partition (slurm.partition)")
    most = rules.get("MaxNodes", "UNLIMITED")
    if most.isdigit() and s.nodes > int(most):
        p.append(f"slurm.nodes: asks {plural(s.nodes, 'node')}; {key} allows at most {most} per job; "
                 f"lower slurm.nodes or choose another partition")
    return p


def accounting_problems(cfg: Config, sacctmgr) -> list[str]:
    """The user's associations and the QOS's limits, where Slurm keeps accounting (sacctmgr
    answers); sacctmgr(args) -> its -nP output, or None."""
    s, p = cfg.slurm, []
    if s.account:
        user = _user()
        out = sacctmgr(["show", "assoc", f"user={user}", "format=Account"]) if user else None
        accounts = sorted({line.strip() for line in (out or "").splitlines() if line.strip()})
        if out is not None and accounts and s.account not in accounts:
            p.append(f"slurm.account: you have no association with account {s.account!r} (yours: "
                     f"{', '.join(accounts)}); choose one of them")
    if s.qos:
        out = sacctmgr(["show", "qos", f"name={s.qos}", "format=Name,MaxWall,MaxTRESPerJob"])
        rows = [line.split("|") for line in (out or "").splitlines() if line.strip()]
        if out is not None and not rows:
            p.append(f"slurm.qos: no QOS {s.qos!r} on this cluster (sacctmgr show qos lists them)")
        for name, wall, tres in ((row + ["", ""])[:3] for row in rows):
            if wall and seconds(s.time) > seconds(wall):
                p.append(f"slurm.time: asks {s.time}; QOS {name} allows at most {wall}; lower "
                         f"slurm.time (a requeue continues the run) or choose another QOS")
            limits = dict(item.split("=", 1) for item in tres.split(",") if "=" in item)
            if limits.get("node", "").isdigit() and s.nodes > int(limits["node"]):
                p.append(f"slurm.nodes: asks {plural(s.nodes, 'node')}; QOS {name} allows at most "
                         f"{limits['node']} per job")
            gpus = limits.get("gres/gpu", "")
            if gpus.isdigit() and s.nodes * s.gpus_per_node > int(gpus):
                p.append(f"slurm.gpus_per_node: asks {s.nodes * s.gpus_per_node} GPUs in all; QOS "
                         f"{name} allows at most {gpus} per job")
    return p


def _names(value: str) -> list[str] | None:
    """A partition's Allow*/Deny* list; None for ALL (anything goes)."""
    if value.strip().upper() == "ALL":
        return None
    return sorted(x for x in value.split(",") if x and x != "(null)")


def _user() -> str:
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no USER/LOGNAME and no passwd entry: ask for nobody
        return ""


def _accounting_storage() -> str | None:
    """AccountingStorageType (`scontrol show config`); None where scontrol does not say."""
    try:
        proc = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"^AccountingStorageType\s*=\s*(\S*)", proc.stdout, re.M)
    return m.group(1) if proc.returncode == 0 and m else None


def _partition_rules(partition: str) -> dict[str, str]:
    try:
        proc = subprocess.run(["scontrol", "show", "partition", "-o", partition], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(re.findall(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}


def _sacctmgr(args: list[str]) -> str | None:
    """sacctmgr -nP ARGS; None where it does not answer (no accounting database: most small
    clusters, and the test cluster)."""
    try:
        proc = subprocess.run(["sacctmgr", "-nP", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def _sinfo() -> str | None:
    try:
        proc = subprocess.run(["sinfo", "-h", "-N", "-o", SINFO_FORMAT], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def parse_sinfo(text: str) -> list[Node]:
    nodes = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 6:
            continue
        name, partition, cpus, mem, gres, limit = parts
        nodes.append(Node(name, partition.rstrip("*"), partition.endswith("*"), int(cpus),
                          int(re.sub(r"\D.*", "", mem) or 0), gpu_count(gres), seconds(limit)))
    return nodes


def gpu_count(gres: str) -> int:
    """gpu:4, gpu:a100:4, gpu:a100:4(S:0-1), or several comma-separated; (null): 0."""
    total = 0
    for item in re.split(r",(?![^(]*\))", gres):
        fields = re.sub(r"\(.*?\)", "", item).split(":")
        if fields[0].removeprefix("gres/") == "gpu" and fields[-1].isdigit():
            total += int(fields[-1])
    return total


def format_limit(limit_s: float) -> str:
    if limit_s == float("inf"):
        return "no limit"
    d, rem = divmod(int(limit_s), 86400)
    h, rem = divmod(rem, 3600)
    return (f"{d}-" if d else "") + f"{h:02d}:{rem // 60:02d}:{rem % 60:02d}"


def mem_mb(value: str) -> int:
    """sbatch --mem's value in MB (its default unit); 0: all of a node's."""
    m = re.fullmatch(r"(\d+)([KMGT]?)B?", str(value).strip().upper())
    if not m:
        return 0
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[m.group(2)]
    return int(int(m.group(1)) * scale)
