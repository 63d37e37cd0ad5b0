// load_graph / save_graph: graph files, plain JSON or zstd-compressed JSON
// (paths ending in ".zst").

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include <unistd.h>
#include <zstd.h>

#include "spillway/error.h"
#include "spillway/graph.h"

namespace spillway {
namespace {

bool is_zstd_path(const std::string& path) {
  return path.size() >= 4 && path.compare(path.size() - 4, 4, ".zst") == 0;
}

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

std::string read_file(const std::string& path) {
  File file(std::fopen(path.c_str(), "rb"));
  if (!file) throw Error("graph", "cannot read '" + path + "': " + std::strerror(errno));
  std::string data;
  char buffer[1 << 16];
  for (;;) {
    std::size_t n = std::fread(buffer, 1, sizeof buffer, file.get());
    data.append(buffer, n);
    if (n < sizeof buffer) break;
  }
  if (std::ferror(file.get())) {
    throw Error("graph", "cannot read '" + path + "': " + std::strerror(errno));
  }
  return data;
}

// Writes a sibling temporary file and renames it over `path`, so a reader
// never sees a half-written graph and a failed save leaves the old file.
void write_file(const std::string& path, const std::string& data) {
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  auto fail = [&](int error) {
    std::remove(temporary.c_str());
    throw Error("graph", "cannot write '" + path + "': " + std::strerror(error));
  };
  File file(std::fopen(temporary.c_str(), "wb"));
  if (!file) throw Error("graph", "cannot write '" + path + "': " + std::strerror(errno));
  if (std::fwrite(data.data(), 1, data.size(), file.get()) != data.size() ||
      std::fflush(file.get()) != 0) {
    fail(errno);
  }
  if (std::fclose(file.release()) != 0) fail(errno);
  if (std::rename(temporary.c_str(), path.c_str()) != 0) fail(errno);
}

struct DctxFree {
  void operator()(ZSTD_DCtx* ctx) const { ZSTD_freeDCtx(ctx); }
};

// Streaming decompression: the frame content size may be absent (the exporter
// writes through a stream), and a file may hold several concatenated frames.
std::string decompress(const std::string& compressed, const std::string& path) {
  std::unique_ptr<ZSTD_DCtx, DctxFree> ctx(ZSTD_createDCtx());
  if (!ctx) throw OutOfMemory("graph", "cannot allocate a zstd context for '" + path + "'");
  std::string out;
  std::string chunk(ZSTD_DStreamOutSize(), '\0');
  ZSTD_inBuffer in{compressed.data(), compressed.size(), 0};
  std::size_t last = 0;  // 0 once a frame is complete
  while (in.pos < in.size) {
    ZSTD_outBuffer buffer{chunk.data(), chunk.size(), 0};
    last = ZSTD_decompressStream(ctx.get(), &buffer, &in);
    if (ZSTD_isError(last)) {
      throw InvalidGraph("graph", "'" + path + "' is not valid zstd data: " +
                                      ZSTD_getErrorName(last));
    }
    out.append(chunk.data(), buffer.pos);
    // Flush what the context still holds once the input is consumed.
    while (in.pos == in.size && buffer.pos == buffer.size) {
      buffer = {chunk.data(), chunk.size(), 0};
      last = ZSTD_decompressStream(ctx.get(), &buffer, &in);
      if (ZSTD_isError(last)) {
        throw InvalidGraph("graph", "'" + path + "' is not valid zstd data: " +
                                        ZSTD_getErrorName(last));
      }
      out.append(chunk.data(), buffer.pos);
    }
  }
  if (compressed.empty() || last != 0) {
    throw InvalidGraph("graph", "'" + path + "' is not valid zstd data: truncated frame");
  }
  return out;
}

struct CctxFree {
  void operator()(ZSTD_CCtx* ctx) const { ZSTD_freeCCtx(ctx); }
};

// One frame with its content size and a checksum, so a damaged file is
// reported as such rather than parsed as different JSON.
std::string compress(const std::string& data, const std::string& path) {
  std::unique_ptr<ZSTD_CCtx, CctxFree> ctx(ZSTD_createCCtx());
  if (!ctx) throw OutOfMemory("graph", "cannot allocate a zstd context for '" + path + "'");
  ZSTD_CCtx_setParameter(ctx.get(), ZSTD_c_compressionLevel, 3);
  ZSTD_CCtx_setParameter(ctx.get(), ZSTD_c_checksumFlag, 1);
  std::string out(ZSTD_compressBound(data.size()), '\0');
  std::size_t n = ZSTD_compress2(ctx.get(), out.data(), out.size(), data.data(), data.size());
  if (ZSTD_isError(n)) {
    throw Error("graph", "cannot compress '" + path + "': " + ZSTD_getErrorName(n));
  }
  out.resize(n);
  return out;
}

}  // namespace

Graph load_graph(const std::string& path) {
  std::string data = read_file(path);
  if (is_zstd_path(path)) data = decompress(data, path);
  try {
    return parse_graph(data);
  } catch (const InvalidGraph& e) {
    // Name the file: "[graph] g.json: node 12 (mm_3): field ...".
    std::string message = e.what();
    std::string prefix = "[" + e.component() + "] ";
    if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
    throw InvalidGraph("graph", path + ": " + message);
  }
}

void save_graph(const Graph& graph, const std::string& path) {
  std::string text = write_graph(graph);
  write_file(path, is_zstd_path(path) ? compress(text, path) : text);
}

}  // namespace spillway
