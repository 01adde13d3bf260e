"""Minimal ctypes binding to NVIDIA cuFile (libcufile.so.0). Stdlib only; torch optional.

Layouts from cufile.h shipped in nvidia-cufile 1.15.1.6 / 1.20.0.107 and nvidia-cufile-cu12 1.14.1.1
(identical for everything used here; sizes checked with gcc on x86_64):
  typedef struct CUfileError { CUfileOpError err; CUresult cu_err; } CUfileError_t;        // 8 B, by value
  typedef struct CUfileDescr_t { enum CUfileFileHandleType type;                            // @0
      union { int fd; void *handle; } handle; const CUfileFSOps_t *fs_ops; } CUfileDescr_t; // @8, @16; 24 B
  typedef void* CUfileHandle_t;   CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
  ssize_t cuFileRead(CUfileHandle_t fh, void *bufPtr_base, size_t size, off_t file_offset, off_t bufPtr_offset);
  "@return -1 on error, in which case errno is set ... all other errors will return a negative
   integer value of @ref CUfileOpError enum value."
Call order: import torch, make the CUDA context current (cuda_ready()), then load() and
driver_open() on the same thread. cuFile reads its env vars when it initialises, so load() sets them first.
"""
import ctypes, ctypes.util, glob, json, os, sys, tempfile
from ctypes import c_int, c_uint, c_size_t, c_ssize_t, c_int64, c_void_p, POINTER, byref, sizeof

BASE = 5000  # CUFILEOP_BASE_ERR; codes below are BASE + n
_NAMES = dict((BASE + int(n), "CU_FILE_" + s) for n, s in zip(*[iter(
    "1 DRIVER_NOT_INITIALIZED 2 DRIVER_INVALID_PROPS 3 DRIVER_UNSUPPORTED_LIMIT 4 DRIVER_VERSION_MISMATCH "
    "5 DRIVER_VERSION_READ_ERROR 6 DRIVER_CLOSING 7 PLATFORM_NOT_SUPPORTED 8 IO_NOT_SUPPORTED "
    "9 DEVICE_NOT_SUPPORTED 10 NVFS_DRIVER_ERROR 11 CUDA_DRIVER_ERROR 12 CUDA_POINTER_INVALID "
    "13 CUDA_MEMORY_TYPE_INVALID 14 CUDA_POINTER_RANGE_ERROR 15 CUDA_CONTEXT_MISMATCH 16 INVALID_MAPPING_SIZE "
    "17 INVALID_MAPPING_RANGE 18 INVALID_FILE_TYPE 19 INVALID_FILE_OPEN_FLAG 20 DIO_NOT_SET 22 INVALID_VALUE "
    "23 MEMORY_ALREADY_REGISTERED 24 MEMORY_NOT_REGISTERED 25 PERMISSION_DENIED 26 DRIVER_ALREADY_OPEN "
    "27 HANDLE_NOT_REGISTERED 28 HANDLE_ALREADY_REGISTERED 29 DEVICE_NOT_FOUND 30 INTERNAL_ERROR "
    "31 GETNEWFD_FAILED 33 NVFS_SETUP_ERROR 34 IO_DISABLED 35 BATCH_SUBMIT_FAILED 36 GPU_MEMORY_PINNING_FAILED "
    "37 BATCH_FULL 38 ASYNC_NOT_SUPPORTED 43 NOMEM_ERROR 44 IO_ERROR 45 INTERNAL_BUF_REGISTER_ERROR "
    "47 INVALID_CONTEXT_ERROR 48 NVFS_INTERNAL_DRIVER_ERROR 49 BATCH_NOCOMPAT_ERROR".split())] * 2))
_NAMES[0] = "CU_FILE_SUCCESS"


class CUfileError_t(ctypes.Structure):  # 8 B, returned by value (RAX on x86_64); ctypes/libffi handle it
    _fields_ = [("err", c_int), ("cu_err", c_int)]


class _Nvfs(ctypes.Structure):
    _fields_ = [("major_version", c_uint), ("minor_version", c_uint), ("poll_thresh_size", c_size_t),
                ("max_direct_io_size", c_size_t), ("dstatusflags", c_uint), ("dcontrolflags", c_uint)]


class CUfileDrvProps_t(ctypes.Structure):     # 56 bytes
    _fields_ = [("nvfs", _Nvfs), ("fflags", c_uint), ("max_device_cache_size", c_uint),
                ("per_buffer_cache_size", c_uint), ("max_device_pinned_mem_size", c_uint),
                ("max_batch_io_size", c_uint), ("max_batch_io_timeout_msecs", c_uint)]


class _Handle(ctypes.Union):
    _fields_ = [("fd", c_int), ("handle", c_void_p)]


class CUfileDescr_t(ctypes.Structure):        # 24 bytes: type@0, handle@8, fs_ops@16
    _fields_ = [("type", c_int), ("handle", _Handle), ("fs_ops", c_void_p)]


assert (sizeof(CUfileError_t), sizeof(CUfileDescr_t), CUfileDescr_t.handle.offset,
        CUfileDescr_t.fs_ops.offset, sizeof(CUfileDrvProps_t)) == (8, 24, 8, 16, 56)
CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
CU_FILE_USE_POLL_MODE, CU_FILE_ALLOW_COMPAT_MODE = 0, 1      # bit numbers in nvfs.dcontrolflags


class CuFileError(RuntimeError):
    def __init__(self, func, code, cu_err=0, detail=""):
        self.func, self.code, self.cu_err = func, code, cu_err
        self.name = _NAMES.get(code, "cuFile error %d" % code)
        msg = "%s failed: %s (%d)" % (func, self.name, code)
        msg += (", CUresult=%d" % cu_err if cu_err else "") + (" " + detail if detail else "")
        super().__init__(msg)


_lib = None
_path = None


def _prepare_env(log_path=None, level="ERROR"):
    """Keep cufile.log out of cwd (default logging.dir is CWD) and guarantee compat mode is allowed."""
    os.environ.setdefault("CUFILE_LOGFILE_PATH", log_path or os.path.join(
        tempfile.gettempdir(), "cufile_%d.log" % os.getpid()))
    os.environ.setdefault("CUFILE_LOGGING_LEVEL", level)  # NOTICE lines (mode) still appear at ERROR
    if "CUFILE_ENV_PATH_JSON" not in os.environ and not os.path.exists("/etc/cufile.json"):
        cfg = os.path.join(tempfile.gettempdir(), "cufile_ctypes_%d.json" % os.getpid())
        with open(cfg, "w") as f:   # partial json is fine; unspecified keys keep library defaults
            json.dump({"properties": {"allow_compat_mode": True}}, f)
        os.environ["CUFILE_ENV_PATH_JSON"] = cfg


def _candidates():
    try:   # 1) already mapped (torch links it) -> reuse that very instance
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if "/libcufile.so" in p:
                    yield p
    except OSError:
        pass
    yield "libcufile.so.0"                    # 2) LD_LIBRARY_PATH / ldconfig
    roots = list(sys.path)                    # 3) pip wheels: nvidia-cufile (cu13) / nvidia-cufile-cu12
    try:
        import importlib.util
        spec = importlib.util.find_spec("nvidia")
        roots += [os.path.dirname(d) for d in (spec.submodule_search_locations or [])] if spec else []
    except Exception:
        pass
    for r in roots:
        for sub in ("nvidia/cu13/lib", "nvidia/cufile/lib", "nvidia/cu12/lib"):
            yield from sorted(glob.glob(os.path.join(r or ".", sub, "libcufile.so*")))
    yield from glob.glob("/usr/local/cuda*/targets/x86_64-linux/lib/libcufile.so*")   # 4) toolkit
    fl = ctypes.util.find_library("cufile")   # 5) last resort
    if fl:
        yield fl


def load(path=None, log_path=None):
    """Return the CDLL (cached) or raise OSError listing every path tried."""
    global _lib, _path
    if _lib is not None:
        return _lib
    _prepare_env(log_path)
    tried = []
    for cand in ([path] if path else _candidates()):
        if "rdma" in os.path.basename(cand) or cand in [t for t, _ in tried]:
            continue
        try:
            lib = ctypes.CDLL(cand, mode=ctypes.RTLD_GLOBAL, use_errno=True)
            lib.cuFileHandleRegister
        except (OSError, AttributeError) as e:
            tried.append((cand, str(e)))
            continue
        break
    else:
        raise OSError("libcufile not loadable; tried: " + "; ".join("%s (%s)" % t for t in tried))
    E, P = CUfileError_t, POINTER
    for name, res, args in [
            ("cuFileDriverOpen", E, []), ("cuFileDriverClose_v2", E, []), ("cuFileDriverClose", E, []),
            ("cuFileDriverGetProperties", E, [P(CUfileDrvProps_t)]), ("cuFileGetVersion", E, [P(c_int)]),
            ("cuFileHandleRegister", E, [P(c_void_p), P(CUfileDescr_t)]),
            ("cuFileHandleDeregister", None, [c_void_p]),
            ("cuFileBufRegister", E, [c_void_p, c_size_t, c_int]), ("cuFileBufDeregister", E, [c_void_p]),
            ("cuFileRead", c_ssize_t, [c_void_p, c_void_p, c_size_t, c_int64, c_int64]),
            ("cuFileWrite", c_ssize_t, [c_void_p, c_void_p, c_size_t, c_int64, c_int64])]:
        fn = getattr(lib, name, None)          # _v2 / GetVersion are absent in old releases
        if fn is not None:
            fn.restype, fn.argtypes = res, args
    _lib, _path = lib, getattr(lib, "_name", path)
    return lib


def _check(func, e, ok=(0,)):
    if e.err not in ok:
        raise CuFileError(func, e.err, e.cu_err)


def version():
    """cuFile version as 1000*major + 10*minor (1150 = 1.15), or None if unavailable."""
    v = c_int(0)
    fn = getattr(load(), "cuFileGetVersion", None)
    return v.value if fn is not None and fn(byref(v)).err == 0 else None


def driver_open():    # CU_FILE_DRIVER_ALREADY_OPEN (5026) is tolerated
    _check("cuFileDriverOpen", load().cuFileDriverOpen(), ok=(0, BASE + 26))


def driver_close():   # header: "#define cuFileDriverClose cuFileDriverClose_v2"
    lib = load()
    fn = getattr(lib, "cuFileDriverClose_v2", None) or lib.cuFileDriverClose
    _check("cuFileDriverClose", fn())


def properties():
    p = CUfileDrvProps_t()
    _check("cuFileDriverGetProperties", load().cuFileDriverGetProperties(byref(p)))
    n = p.nvfs
    return dict(nvfs_version=(n.major_version, n.minor_version), dstatusflags=n.dstatusflags,
                dcontrolflags=n.dcontrolflags, allow_compat=bool(n.dcontrolflags >> CU_FILE_ALLOW_COMPAT_MODE & 1),
                fflags=p.fflags, max_direct_io_size=n.max_direct_io_size,
                max_device_pinned_mem_size_kb=p.max_device_pinned_mem_size)


def mode():
    """('gds'|'compatibility', evidence). Call after driver_open() (and ideally after CuFile.open()).
    Driver-level test as in kvikio: nvfs major==minor==0 means nvidia-fs is not in use."""
    ev = dict(library=_path, version=version(), properties=properties(),
              proc_nvidia_fs=os.path.exists("/proc/driver/nvidia-fs/version"),
              force_env=os.environ.get("CUFILE_FORCE_COMPAT_MODE"), log_lines=[])
    try:
        with open(os.environ["CUFILE_LOGFILE_PATH"], errors="replace") as f:
            ev["log_lines"] = [l.strip() for l in f if "compat" in l or "P2PDMA" in l or "nvidia_fs" in l]
    except (OSError, KeyError):
        pass
    forced = str(ev["force_env"]).lower() in ("1", "true", "yes", "on")
    per_file = any("posix read/write with compat mode" in l for l in ev["log_lines"])
    gds = ev["properties"]["nvfs_version"] != (0, 0) and not forced and not per_file
    return ("gds" if gds else "compatibility"), ev


def buf_register(devptr, size, flags=0):
    _check("cuFileBufRegister", load().cuFileBufRegister(c_void_p(devptr), size, flags))


def buf_deregister(devptr):
    _check("cuFileBufDeregister", load().cuFileBufDeregister(c_void_p(devptr)))


class CuFile:
    """Registered file handle. open(fd) takes an fd you opened (O_DIRECT recommended; see open_path)."""

    def __init__(self):
        self.handle, self.fd = None, None

    @classmethod
    def open_path(cls, path, flags=os.O_RDWR | os.O_CREAT, direct=True):
        """Open with O_DIRECT if the filesystem allows it (else plain); returns (CuFile, used_odirect)."""
        fd = None
        if direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:
                fd = None
        used = fd is not None
        if fd is None:
            fd = os.open(path, flags, 0o644)
        try:
            return cls().open(fd), used
        except Exception:
            os.close(fd)
            raise

    def open(self, fd):
        d = CUfileDescr_t()
        d.type, d.handle.fd, d.fs_ops = CU_FILE_HANDLE_TYPE_OPAQUE_FD, fd, None
        h = c_void_p()
        _check("cuFileHandleRegister", load().cuFileHandleRegister(byref(h), byref(d)))
        self.handle, self.fd = h.value, fd
        return self

    def _io(self, name, devptr, size, file_offset, dev_offset):
        if self.handle is None:
            raise ValueError("CuFile not open")
        ret = getattr(load(), name)(c_void_p(self.handle), c_void_p(devptr), size, file_offset, dev_offset)
        if ret == -1:
            err = ctypes.get_errno()
            raise OSError(err, "%s: %s" % (name, os.strerror(err)))
        if ret < 0:
            raise CuFileError(name, -ret)
        return ret            # may be < size (e.g. read at EOF)

    def write(self, devptr, size, file_offset=0, dev_offset=0):
        return self._io("cuFileWrite", devptr, size, file_offset, dev_offset)

    def read(self, devptr, size, file_offset=0, dev_offset=0):
        return self._io("cuFileRead", devptr, size, file_offset, dev_offset)

    def close(self, close_fd=True):
        if self.handle is not None:
            load().cuFileHandleDeregister(c_void_p(self.handle))
            self.handle = None
        if close_fd and self.fd is not None:
            os.close(self.fd)
        self.fd = None


def cuda_ready(device=0):
    """Make torch's primary context current on this thread before any cuFile call (optional torch)."""
    import torch
    torch.cuda.init()
    torch.cuda.set_device(device)
    torch.empty(1, device="cuda:%d" % device)
    torch.cuda.synchronize(device)
