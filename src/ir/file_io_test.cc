// load_graph / save_graph: plain and zstd files, and what a user sees when a
// file is missing, unwritable or corrupt.

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <zstd.h>

#include "ir/test_graphs.h"
#include "spillway/error.h"
#include "spillway/graph.h"

namespace spillway {
namespace {

namespace fs = std::filesystem;
using ir::testing::rich_graph;

class FileIo : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("spillway_ir_file_io_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  static void write_bytes(const std::string& path, const std::string& bytes) {
    std::ofstream(path, std::ios::binary) << bytes;
  }
  static std::string read_bytes(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), {}};
  }

  // The message of the exception of type E that load_graph throws.
  template <typename E>
  static std::string load_error(const std::string& path) {
    try {
      load_graph(path);
    } catch (const E& e) {
      return e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "unexpected exception type: " << e.what();
      return "";
    }
    ADD_FAILURE() << "load_graph(" << path << ") succeeded";
    return "";
  }

  fs::path dir_;
};

// Compresses through the streaming API in small chunks, so the frame header
// carries no content size (as a Python zstandard stream writer produces).
std::string compress_streaming(const std::string& data) {
  ZSTD_CCtx* ctx = ZSTD_createCCtx();
  std::string out;
  std::string buffer(ZSTD_CStreamOutSize(), '\0');
  std::size_t fed = 0;
  for (;;) {
    std::size_t chunk = std::min<std::size_t>(1000, data.size() - fed);
    bool last = fed + chunk == data.size();
    ZSTD_inBuffer in{data.data() + fed, chunk, 0};
    std::size_t remaining;
    do {
      ZSTD_outBuffer o{buffer.data(), buffer.size(), 0};
      remaining = ZSTD_compressStream2(ctx, &o, &in, last ? ZSTD_e_end : ZSTD_e_continue);
      EXPECT_FALSE(ZSTD_isError(remaining));
      out.append(buffer.data(), o.pos);
    } while (last ? remaining != 0 : in.pos != in.size);
    fed += chunk;
    if (last) break;
  }
  ZSTD_freeCCtx(ctx);
  return out;
}

TEST_F(FileIo, PlainJsonRoundTrips) {
  Graph g = rich_graph();
  save_graph(g, path("g.json"));
  EXPECT_EQ(read_bytes(path("g.json")), write_graph(g));
  EXPECT_EQ(load_graph(path("g.json")), g);
}

TEST_F(FileIo, ZstdRoundTrips) {
  Graph g = rich_graph();
  save_graph(g, path("g.json.zst"));
  std::string bytes = read_bytes(path("g.json.zst"));
  ASSERT_GE(bytes.size(), 4u);
  EXPECT_EQ(static_cast<unsigned char>(bytes[0]), 0x28u);  // zstd magic 28 B5 2F FD
  EXPECT_LT(bytes.size(), write_graph(g).size());
  EXPECT_EQ(load_graph(path("g.json.zst")), g);
}

TEST_F(FileIo, ZstdWithoutContentSizeAndSeveralFramesLoads) {
  Graph g = ir::testing::rich_graph();
  std::string text = write_graph(g, /*pretty=*/true);
  std::string frame = compress_streaming(text);
  ASSERT_EQ(ZSTD_getFrameContentSize(frame.data(), frame.size()), ZSTD_CONTENTSIZE_UNKNOWN);
  write_bytes(path("stream.zst"), frame);
  EXPECT_EQ(load_graph(path("stream.zst")), g);
  // Two frames concatenated decompress to the concatenated text.
  std::size_t half = text.size() / 2;
  write_bytes(path("two.zst"),
              compress_streaming(text.substr(0, half)) + compress_streaming(text.substr(half)));
  EXPECT_EQ(load_graph(path("two.zst")), g);
}

TEST_F(FileIo, LargeOutputLoadsAcrossManyChunks) {
  // Bigger than several ZSTD_DStreamOutSize() chunks, and highly compressible.
  Graph g = rich_graph();
  g.name = std::string(3 << 20, 'n');
  save_graph(g, path("big.json.zst"));
  EXPECT_LT(fs::file_size(path("big.json.zst")), 1u << 20);
  EXPECT_EQ(load_graph(path("big.json.zst")), g);
}

TEST_F(FileIo, MissingFileIsAnErrorNamingIt) {
  std::string missing = path("nope.json");
  std::string error = load_error<Error>(missing);
  EXPECT_EQ(error, "[graph] cannot read '" + missing + "': No such file or directory");
  EXPECT_EQ(load_error<Error>(path("")).rfind("[graph] cannot read '", 0), 0u);
}

TEST_F(FileIo, MissingFileIsNotAnInvalidGraph) {
  try {
    load_graph(path("nope.json.zst"));
    FAIL();
  } catch (const InvalidGraph&) {
    FAIL() << "a missing file is not a malformed graph";
  } catch (const Error& e) {
    EXPECT_EQ(e.component(), "graph");
  }
}

TEST_F(FileIo, DirectoryIsAnErrorNamingIt) {
  EXPECT_EQ(load_error<Error>(dir_.string()),
            "[graph] cannot read '" + dir_.string() + "': Is a directory");
}

TEST_F(FileIo, UnwritablePathIsAnErrorNamingIt) {
  std::string target = path("no/such/dir/g.json");
  try {
    save_graph(rich_graph(), target);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[graph] cannot write '" + target + "': No such file or directory");
  }
}

TEST_F(FileIo, FailedSaveLeavesTheOldFileAndNoTemporary) {
  Graph g = rich_graph();
  save_graph(g, path("g.json"));
  fs::create_directory(path("dir.json"));  // rename() cannot replace a directory
  EXPECT_THROW(save_graph(g, path("dir.json")), Error);
  save_graph(g, path("g.json"));  // overwriting works
  EXPECT_EQ(load_graph(path("g.json")), g);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir_)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"dir.json", "g.json"}));
}

TEST_F(FileIo, CorruptZstdIsAnInvalidGraphNamingTheFile) {
  std::string bad = path("bad.zst");
  write_bytes(bad, "this is not zstd at all");
  EXPECT_EQ(load_error<InvalidGraph>(bad),
            "[graph] '" + bad + "' is not valid zstd data: Unknown frame descriptor");
}

TEST_F(FileIo, TruncatedZstdIsAnInvalidGraphNamingTheFile) {
  save_graph(rich_graph(), path("g.zst"));
  std::string bytes = read_bytes(path("g.zst"));
  for (std::size_t keep : {std::size_t{0}, std::size_t{3}, bytes.size() / 2, bytes.size() - 1}) {
    write_bytes(path("cut.zst"), bytes.substr(0, keep));
    std::string error = load_error<InvalidGraph>(path("cut.zst"));
    EXPECT_EQ(error.rfind("[graph] '" + path("cut.zst") + "' is not valid zstd data: ", 0), 0u)
        << keep << ": " << error;
  }
}

TEST_F(FileIo, EveryCorruptedByteOfASavedFileIsDetected) {
  // save_graph writes a checksum, so no flipped byte can load as other JSON.
  save_graph(rich_graph(), path("g.zst"));
  std::string bytes = read_bytes(path("g.zst"));
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    std::string flipped = bytes;
    flipped[i] = static_cast<char>(flipped[i] ^ 0x5a);
    write_bytes(path("flip.zst"), flipped);
    EXPECT_NE(load_error<InvalidGraph>(path("flip.zst")), "") << "byte " << i;
  }
}

TEST_F(FileIo, ErrorsInsideAFileNameTheFile) {
  write_bytes(path("g.json"), R"({"format": "spillway.graph", "version": 2, "nodes": []})");
  EXPECT_EQ(load_error<InvalidGraph>(path("g.json")),
            "[graph] " + path("g.json") + ": field 'version': expected 1, got 2");
  write_bytes(path("t.json"), "{");
  EXPECT_EQ(load_error<InvalidGraph>(path("t.json")).rfind("[graph] " + path("t.json") +
                                                               ": not valid JSON: ",
                                                           0),
            0u);
}

TEST_F(FileIo, ExportedExampleGraphsLoadAndRoundTrip) {
  // The graphs the Python exporter checked in (examples/graphs) are the
  // format's real users: each must load, and survive a save/load cycle.
  fs::path examples = fs::path(SPILLWAY_SOURCE_DIR) / "examples" / "graphs";
  int loaded = 0;
  if (fs::is_directory(examples)) {
    for (const auto& entry : fs::directory_iterator(examples)) {
      std::string name = entry.path().filename().string();
      if (name.find(".json") == std::string::npos) continue;
      SCOPED_TRACE(name);
      Graph g = load_graph(entry.path().string());
      EXPECT_FALSE(g.nodes.empty());
      save_graph(g, path("copy.json.zst"));
      EXPECT_EQ(load_graph(path("copy.json.zst")), g);
      ++loaded;
    }
  }
  if (loaded == 0) GTEST_SKIP() << "no exported graphs under " << examples;
}

TEST_F(FileIo, NonZstdSuffixIsReadAsText) {
  // ".zstd" or ".ZST" are not the zstd suffix: the bytes are read as JSON.
  Graph g = rich_graph();
  save_graph(g, path("g.zstd"));
  EXPECT_EQ(read_bytes(path("g.zstd")), write_graph(g));
  EXPECT_EQ(load_graph(path("g.zstd")), g);
}

}  // namespace
}  // namespace spillway
